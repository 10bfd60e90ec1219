#!/usr/bin/env python3
"""Writes the seeds of the Hugging Face and data targets (tests/fuzz/seeds/NAME/), by hand from
the formats' specifications (safetensors, NumPy .npy, llm.c's .bin, transformers' config.json),
not with the readers' code: valid files for the tiny models of TinyHfModels.h, and a few broken
ones. Run from the repository root: python3 tests/fuzz/make_seeds.py"""
import json
import os
import random
import struct

ROOT = "tests/fuzz/seeds"
rng = random.Random(44)

GPT2_CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 8,
               "n_layer": 1, "n_embd": 4, "n_head": 2, "n_inner": 8, "n_positions": 4,
               "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new",
               "tie_word_embeddings": True, "torch_dtype": "float32"}
LLAMA_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8,
                "num_hidden_layers": 1, "hidden_size": 4, "num_attention_heads": 2,
                "num_key_value_heads": 1, "intermediate_size": 8,
                "max_position_embeddings": 4, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
                "mlp_bias": False, "rope_scaling": None, "torch_dtype": "float32"}


def gpt2_tensors(prefix=""):
    t = {prefix + "wte.weight": [8, 4], prefix + "wpe.weight": [4, 4]}
    h = prefix + "h.0."
    for name, shape in [("ln_1.weight", [4]), ("ln_1.bias", [4]), ("attn.c_attn.weight", [4, 12]),
                        ("attn.c_attn.bias", [12]), ("attn.c_proj.weight", [4, 4]),
                        ("attn.c_proj.bias", [4]), ("ln_2.weight", [4]), ("ln_2.bias", [4]),
                        ("mlp.c_fc.weight", [4, 8]), ("mlp.c_fc.bias", [8]),
                        ("mlp.c_proj.weight", [8, 4]), ("mlp.c_proj.bias", [4])]:
        t[h + name] = shape
    t[prefix + "ln_f.weight"] = [4]
    t[prefix + "ln_f.bias"] = [4]
    return t


def llama_tensors():
    t = {"model.embed_tokens.weight": [8, 4]}
    h = "model.layers.0."
    for name, shape in [("input_layernorm.weight", [4]), ("self_attn.q_proj.weight", [4, 4]),
                        ("self_attn.k_proj.weight", [2, 4]), ("self_attn.v_proj.weight", [2, 4]),
                        ("self_attn.o_proj.weight", [4, 4]),
                        ("post_attention_layernorm.weight", [4]),
                        ("mlp.gate_proj.weight", [8, 4]), ("mlp.up_proj.weight", [8, 4]),
                        ("mlp.down_proj.weight", [4, 8])]:
        t[h + name] = shape
    t["model.norm.weight"] = [4]
    t["lm_head.weight"] = [8, 4]
    return t


def encode(value, dtype):
    if dtype == "F32":
        return struct.pack("<f", value)
    if dtype == "F64":
        return struct.pack("<d", value)
    if dtype == "F16":
        return struct.pack("<e", value)
    return struct.pack("<f", value)[2:]  # BF16: the high half of the fp32 bits


def safetensors(shapes, dtype="F32", metadata=True):
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = {"format": "pt"}
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        begin = len(data)
        data += b"".join(encode(rng.uniform(-0.1, 0.1), dtype) for _ in range(n))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, len(data)]}
    text = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + data


def raw_header(text):
    return struct.pack("<Q", len(text)) + text


def write(target, name, data):
    os.makedirs(os.path.join(ROOT, target), exist_ok=True)
    with open(os.path.join(ROOT, target, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def directory(files):
    """The hf_directory target's framing: "=== NAME\\n" then the file's bytes, per file."""
    return b"\n".join(b"=== " + name.encode() + b"\n" + (body if isinstance(body, bytes)
                                                          else body.encode())
                      for name, body in files)


# safetensors: one file.
write("safetensors", "gpt2-f32.safetensors", safetensors(gpt2_tensors()))
write("safetensors", "gpt2-bf16-prefixed.safetensors",
      safetensors(gpt2_tensors("transformer."), "BF16", metadata=False))
write("safetensors", "llama-f16.safetensors", safetensors(llama_tensors(), "F16"))
write("safetensors", "llama-f64.safetensors", safetensors(llama_tensors(), "F64"))
good = safetensors({"a": [2, 2], "b": [3]})
write("safetensors", "broken-truncated.safetensors", good[:-5])
write("safetensors", "broken-overlap.safetensors", raw_header(
    b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
    b'"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}') + bytes(12))
write("safetensors", "broken-twice.safetensors", raw_header(
    b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
    b'"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}') + bytes(8))
write("safetensors", "broken-dtype.safetensors", raw_header(
    b'{"a":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}}') + bytes(4))
write("safetensors", "broken-length.safetensors", struct.pack("<Q", 1 << 40) + b"{}")

# hf_directory: config.json and the weights, one file or shards with their index.
gpt2_config = json.dumps(GPT2_CONFIG, indent=1)
llama_config = json.dumps(LLAMA_CONFIG, indent=1)
write("hf_directory", "gpt2-single", directory(
    [("config.json", gpt2_config), ("model.safetensors", safetensors(gpt2_tensors()))]))
shapes = llama_tensors()
names = sorted(shapes)
first = {n: shapes[n] for n in names[:6]}
second = {n: shapes[n] for n in names[6:]}
shard_names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
index = {"metadata": {"total_size": 0},
         "weight_map": {**{n: shard_names[0] for n in first}, **{n: shard_names[1] for n in second}}}
write("hf_directory", "llama-sharded", directory(
    [("config.json", llama_config), ("model.safetensors.index.json", json.dumps(index)),
     (shard_names[0], safetensors(first, "BF16")), (shard_names[1], safetensors(second, "BF16"))]))
wrong = dict(index, weight_map=dict(index["weight_map"]))
wrong["weight_map"][names[0]] = shard_names[1]
write("hf_directory", "broken-wrong-shard", directory(
    [("config.json", llama_config), ("model.safetensors.index.json", json.dumps(wrong)),
     (shard_names[0], safetensors(first)), (shard_names[1], safetensors(second))]))
write("hf_directory", "broken-config-mismatch", directory(
    [("config.json", json.dumps(dict(GPT2_CONFIG, n_embd=8))),
     ("model.safetensors", safetensors(gpt2_tensors()))]))
write("hf_directory", "broken-no-weights", directory([("config.json", gpt2_config)]))

# hf_config: transformers' config.json of each family, and refused ones.
write("hf_config", "gpt2.json", gpt2_config)
write("hf_config", "gpt2-small.json", json.dumps(
    {"model_type": "gpt2", "vocab_size": 50257, "n_layer": 12, "n_embd": 768, "n_head": 12,
     "n_inner": None, "n_positions": 1024, "layer_norm_epsilon": 1e-5,
     "activation_function": "gelu_new"}))
write("hf_config", "llama.json", llama_config)
write("hf_config", "llama3-rope-parameters.json", json.dumps(
    {"model_type": "llama", "vocab_size": 128256, "num_hidden_layers": 2, "hidden_size": 256,
     "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 512,
     "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "head_dim": 32,
     "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
     "tie_word_embeddings": True}))
write("hf_config", "mistral.json", json.dumps(
    {"model_type": "mistral", "vocab_size": 32000, "num_hidden_layers": 2, "hidden_size": 64,
     "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
     "max_position_embeddings": 32768, "sliding_window": 4096, "rope_theta": 10000.0}))
write("hf_config", "broken-rope-scaling.json", json.dumps(
    dict(LLAMA_CONFIG, rope_scaling={"rope_type": "llama3", "factor": 8.0})))
write("hf_config", "broken-head-dim.json", json.dumps(dict(LLAMA_CONFIG, head_dim=3)))
write("hf_config", "broken-heads.json", json.dumps(dict(GPT2_CONFIG, n_head=3)))
write("hf_config", "broken-model-type.json", json.dumps(dict(GPT2_CONFIG, model_type="bert")))


# token_data: NumPy .npy (versions 1 to 3), llm.c's .bin, raw ids.
def npy(descr, shape, data, major=1, fortran=False):
    shape_text = "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
    header = ("{'descr': '%s', 'fortran_order': %s, 'shape': %s, }"
              % (descr, "True" if fortran else "False", shape_text))
    length_bytes = 2 if major == 1 else 4
    pad = (64 - (10 + len(header) + 1) % 64) % 64 if major == 1 else \
        (64 - (12 + len(header) + 1) % 64) % 64
    header = header + " " * pad + "\n"
    out = b"\x93NUMPY" + bytes([major, 0])
    out += struct.pack("<H" if length_bytes == 2 else "<I", len(header))
    return out + header.encode("latin1" if major < 3 else "utf8") + data


ids = [rng.randrange(50257) for _ in range(16)]
write("token_data", "u2.npy", npy("<u2", [16], struct.pack("<16H", *ids)))
write("token_data", "i8-2d.npy", npy("<i8", [2, 8], struct.pack("<16q", *ids)))
write("token_data", "u4-v2.npy", npy("<u4", [16], struct.pack("<16I", *ids), major=2))
write("token_data", "u1-v3.npy", npy("|u1", [12], bytes(range(12)), major=3))
write("token_data", "broken-fortran.npy", npy("<u2", [4, 4], struct.pack("<16H", *ids),
                                              fortran=True))
write("token_data", "broken-shape.npy", npy("<u2", [17], struct.pack("<16H", *ids)))
write("token_data", "broken-big-endian.npy", npy(">u2", [16], struct.pack(">16H", *ids)))
write("token_data", "broken-negative.npy", npy("<i2", [8], struct.pack("<8h", *([-1] * 8))))
header = [0] * 256
header[0], header[1], header[2] = 20240520, 1, 16
write("token_data", "llmc-v1.bin", struct.pack("<256i", *header) + struct.pack("<16H", *ids))
header[1], header[2] = 2, 20
write("token_data", "broken-llmc-count.bin",
      struct.pack("<256i", *header) + struct.pack("<16I", *ids))
write("token_data", "raw-u16.bin", struct.pack("<16H", *ids))
