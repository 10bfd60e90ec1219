"""piperun --init-from against PyTorch: a GPT-2 checkpoint written by Hugging Face's own
safetensors library, the first-step loss piperun computes from it on several schedules and
layouts, and the loss of the same weights on the same tokens computed here by a GPT-2 forward
written in PyTorch after Hugging Face's GPT2LMHeadModel (Conv1D weights stored [in, out], the
fused c_attn split q | k | v, heads contiguous, tanh GELU, pre-LayerNorm with eps 1e-5, logits
against wte when tied). Nothing of piperun's own layout code is used here, so this checks the
name-to-tensor mapping against the convention itself."""

import math
import os
import re
import subprocess

import pytest

from conftest import example, pipec_binary

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

V, T, C, H, L, F = 64, 16, 32, 4, 4, 128  # examples/tiny-gpt.json


def piperun_binary() -> str:
    path = os.path.join(os.path.dirname(pipec_binary()), "piperun")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"{path} is not built: bazel build //tools:piperun")
    return path


def gpt2_weights(seed: int, tied: bool) -> dict:
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.02, mean=0.0):
        return (torch.randn(*shape, generator=g) * std + mean).float()

    w = {"transformer.wte.weight": normal(V, C), "transformer.wpe.weight": normal(1024, C)}
    for b in range(L):
        h = f"transformer.h.{b}."
        w[h + "ln_1.weight"] = normal(C, std=0.1, mean=1.0)
        w[h + "ln_1.bias"] = normal(C, std=0.1)
        w[h + "attn.c_attn.weight"] = normal(C, 3 * C, std=0.2)
        w[h + "attn.c_attn.bias"] = normal(3 * C, std=0.1)
        w[h + "attn.c_proj.weight"] = normal(C, C, std=0.2)
        w[h + "attn.c_proj.bias"] = normal(C, std=0.1)
        w[h + "ln_2.weight"] = normal(C, std=0.1, mean=1.0)
        w[h + "ln_2.bias"] = normal(C, std=0.1)
        w[h + "mlp.c_fc.weight"] = normal(C, F, std=0.2)
        w[h + "mlp.c_fc.bias"] = normal(F, std=0.1)
        w[h + "mlp.c_proj.weight"] = normal(F, C, std=0.1)
        w[h + "mlp.c_proj.bias"] = normal(C, std=0.1)
        # GPT-2 files carry the causal mask as a buffer.
        w[h + "attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))
    w["transformer.ln_f.weight"] = normal(C, std=0.1, mean=1.0)
    w["transformer.ln_f.bias"] = normal(C, std=0.1)
    w["lm_head.weight"] = w["transformer.wte.weight"].clone() if tied else normal(V, C)
    return w


def gpt2_loss(w: dict, tokens: list, tied: bool) -> float:
    """Mean next-token cross-entropy of one sequence, in float64, GPT2LMHeadModel's way."""
    d = {k: v.double() for k, v in w.items()}
    x = torch.tensor(tokens[:-1])
    y = torch.tensor(tokens[1:])
    h = d["transformer.wte.weight"][x] + d["transformer.wpe.weight"][: len(x)]
    hs = C // H
    mask = torch.tril(torch.ones(len(x), len(x), dtype=torch.bool))
    for b in range(L):
        p = f"transformer.h.{b}."
        a = torch.nn.functional.layer_norm(h, (C,), d[p + "ln_1.weight"], d[p + "ln_1.bias"], 1e-5)
        qkv = a @ d[p + "attn.c_attn.weight"] + d[p + "attn.c_attn.bias"]
        q, k, v = qkv.split(C, dim=-1)
        q, k, v = (t.view(len(x), H, hs).transpose(0, 1) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        o = (att @ v).transpose(0, 1).reshape(len(x), C)
        h = h + o @ d[p + "attn.c_proj.weight"] + d[p + "attn.c_proj.bias"]
        a = torch.nn.functional.layer_norm(h, (C,), d[p + "ln_2.weight"], d[p + "ln_2.bias"], 1e-5)
        m = torch.nn.functional.gelu(a @ d[p + "mlp.c_fc.weight"] + d[p + "mlp.c_fc.bias"],
                                     approximate="tanh")
        h = h + m @ d[p + "mlp.c_proj.weight"] + d[p + "mlp.c_proj.bias"]
    h = torch.nn.functional.layer_norm(h, (C,), d["transformer.ln_f.weight"],
                                       d["transformer.ln_f.bias"], 1e-5)
    head = d["transformer.wte.weight"] if tied else d["lm_head.weight"]
    return torch.nn.functional.cross_entropy(h @ head.T, y).item()


LAYOUTS = [
    "--schedule 1f1b --pp 2 --microbatches 4",
    "--schedule interleaved-1f1b --pp 2 --vpp 2 --microbatches 4 --tp 2",
    "--schedule zb-v --pp 2 --vpp 2 --microbatches 2 --dp 2",
    "--schedule seq1f1b --pp 2 --microbatches 4 --seq-splits 2 --tp 2",
]


def expect_first_step_loss_on_every_layout(tmp_path, model, checkpoint, data, want):
    """piperun's first-step loss, and its single-rank reference's, on every layout of LAYOUTS
    from `checkpoint` equal `want` (fp32 kernels against a float64 forward, printed to 6
    decimals)."""
    for layout in LAYOUTS:
        plan = tmp_path / "plan.json"
        c = subprocess.run([pipec_binary(), "compile", "--quiet", "--model", model, *layout.split(),
                            "-o", str(plan)], capture_output=True, text=True)
        assert c.returncode == 0, c.stderr
        r = subprocess.run([piperun_binary(), str(plan), "--backend", "cpu", "--steps", "1",
                            "--check-reference", "--data", str(data), "--init-from",
                            str(checkpoint)], capture_output=True, text=True)
        assert r.returncode == 0, layout + "\n" + r.stdout + r.stderr
        got = float(re.search(r"step 0 loss (\S+)", r.stdout).group(1))
        ref = float(re.search(r"reference loss \(last step\) (\S+)", r.stdout).group(1))
        assert got == pytest.approx(want, abs=2e-5), layout
        assert ref == pytest.approx(want, abs=2e-5), layout


def save_checkpoint(weights: dict, tied: bool, path) -> None:
    """`weights` as save_pretrained writes them: a tied model's one copy, the embedding's."""
    saved = dict(weights)
    if tied:
        del saved["lm_head.weight"]
    safetensors_torch.save_file(saved, str(path), metadata={"format": "pt"})


def one_sequence_file(tmp_path, seed: int, vocab: int, length: int):
    """A token file of exactly one sequence (`length` + 1 ids): every window of every step is
    it, so the step's mean loss is that sequence's. Returns its path and its tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (length + 1,), generator=g).tolist()
    data = tmp_path / "tokens.bin"
    data.write_bytes(b"".join(t.to_bytes(2, "little") for t in tokens))
    return data, tokens


def model_variant(tmp_path, name: str, extra: str) -> str:
    """examples/`name` with `extra` fields after its dtype (the original where `extra` is
    empty)."""
    if not extra:
        return example(name)
    original = open(example(name)).read()
    text = original.replace('"dtype": "fp32"', '"dtype": "fp32"' + extra)
    assert text != original, f"{name} no longer says \"dtype\": \"fp32\""
    variant = str(tmp_path / ("variant-" + name))
    open(variant, "w").write(text)
    return variant


def refused_init_from(tmp_path, model: str, weights: dict) -> str:
    """piperun --init-from a file of `weights` for a plan of examples/`model`: refused before
    any step with exit status 2 and one line, which it returns."""
    checkpoint = tmp_path / "bad.safetensors"
    safetensors_torch.save_file(weights, str(checkpoint))
    plan = tmp_path / "plan.json"
    subprocess.run([pipec_binary(), "compile", "--quiet", "--model", example(model),
                    "--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "-o", str(plan)],
                   check=True)
    r = subprocess.run([piperun_binary(), str(plan), "--backend", "cpu", "--init-from",
                        str(checkpoint)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1
    assert "step 0" not in r.stdout
    return r.stderr


@pytest.mark.parametrize("tied", [False, True])
def test_first_step_loss_equals_pytorchs_gpt2(tmp_path, tied):
    weights = gpt2_weights(seed=3 if tied else 5, tied=tied)
    checkpoint = tmp_path / "gpt2.safetensors"
    save_checkpoint(weights, tied, checkpoint)
    data, tokens = one_sequence_file(tmp_path, seed=11, vocab=V, length=T)
    want = gpt2_loss(weights, tokens, tied)
    model = model_variant(tmp_path, "tiny-gpt.json", ', "tie_embeddings": true' if tied else "")
    expect_first_step_loss_on_every_layout(tmp_path, model, checkpoint, data, want)


def test_wrong_shape_names_the_tensor_and_both_shapes(tmp_path):
    weights = gpt2_weights(seed=1, tied=False)
    weights["transformer.h.3.mlp.c_proj.weight"] = torch.zeros(C, F)  # transposed
    error = refused_init_from(tmp_path, "tiny-gpt.json", weights)
    assert ("tensor transformer.h.3.mlp.c_proj.weight has shape [32, 128]; the model needs "
            "[128, 32]") in error


# A Llama checkpoint (examples/tiny-llama.json's shape): LlamaForCausalLM's tensor names, its
# nn.Linear weights [out, in], rotate_half rotary embeddings on q and k, key/value heads shared
# by groups of query heads, SwiGLU, RMSNorm with eps 1e-5 (or the model's norm_eps), no biases.
LV, LT, LC, LH, LKV, LL, LF, THETA = 64, 16, 32, 4, 2, 4, 96, 10000.0


def llama_weights(seed: int, tied: bool) -> dict:
    g = torch.Generator().manual_seed(seed)

    def normal(*shape, std=0.2, mean=0.0):
        return (torch.randn(*shape, generator=g) * std + mean).float()

    hd = LC // LH
    w = {"model.embed_tokens.weight": normal(LV, LC, std=0.5)}
    for b in range(LL):
        p = f"model.layers.{b}."
        w[p + "input_layernorm.weight"] = normal(LC, std=0.1, mean=1.0)
        w[p + "self_attn.q_proj.weight"] = normal(LH * hd, LC)
        w[p + "self_attn.k_proj.weight"] = normal(LKV * hd, LC)
        w[p + "self_attn.v_proj.weight"] = normal(LKV * hd, LC)
        w[p + "self_attn.o_proj.weight"] = normal(LC, LH * hd)
        w[p + "post_attention_layernorm.weight"] = normal(LC, std=0.1, mean=1.0)
        w[p + "mlp.gate_proj.weight"] = normal(LF, LC)
        w[p + "mlp.up_proj.weight"] = normal(LF, LC)
        w[p + "mlp.down_proj.weight"] = normal(LC, LF, std=0.1)
        # Some older files carry the rotary frequencies as a buffer.
        w[p + "self_attn.rotary_emb.inv_freq"] = 1.0 / THETA ** (torch.arange(0, hd, 2) / hd)
    w["model.norm.weight"] = normal(LC, std=0.1, mean=1.0)
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone() if tied else normal(LV, LC)
    return w


def llama_loss(w: dict, tokens: list, tied: bool, eps: float = 1e-5) -> float:
    """Mean next-token cross-entropy of one sequence, in float64, LlamaForCausalLM's way."""
    d = {k: v.double() for k, v in w.items()}
    x = torch.tensor(tokens[:-1])
    y = torch.tensor(tokens[1:])
    n, hd = len(x), LC // LH

    def rms(h, weight):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight

    inv_freq = 1.0 / THETA ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.outer(torch.arange(n, dtype=torch.float64), inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rotate_half(t):
        return torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1)

    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    h = d["model.embed_tokens.weight"][x]
    for b in range(LL):
        p = f"model.layers.{b}."
        a = rms(h, d[p + "input_layernorm.weight"])
        q = (a @ d[p + "self_attn.q_proj.weight"].T).view(n, LH, hd).transpose(0, 1)
        k = (a @ d[p + "self_attn.k_proj.weight"].T).view(n, LKV, hd).transpose(0, 1)
        v = (a @ d[p + "self_attn.v_proj.weight"].T).view(n, LKV, hd).transpose(0, 1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = (t.repeat_interleave(LH // LKV, dim=0) for t in (k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        o = (att @ v).transpose(0, 1).reshape(n, LC)
        h = h + o @ d[p + "self_attn.o_proj.weight"].T
        a = rms(h, d[p + "post_attention_layernorm.weight"])
        m = torch.nn.functional.silu(a @ d[p + "mlp.gate_proj.weight"].T) * (
            a @ d[p + "mlp.up_proj.weight"].T)
        h = h + m @ d[p + "mlp.down_proj.weight"].T
    h = rms(h, d["model.norm.weight"])
    head = d["model.embed_tokens.weight"] if tied else d["lm_head.weight"]
    return torch.nn.functional.cross_entropy(h @ head.T, y).item()


@pytest.mark.parametrize("tied,eps", [(False, None), (True, None), (False, 0.05)])
def test_first_step_loss_equals_pytorchs_llama(tmp_path, tied, eps):
    weights = llama_weights(seed=7 if tied else 9, tied=tied)
    checkpoint = tmp_path / "llama.safetensors"
    save_checkpoint(weights, tied, checkpoint)
    data, tokens = one_sequence_file(tmp_path, seed=13, vocab=LV, length=LT)
    want = llama_loss(weights, tokens, tied, eps if eps else 1e-5)
    # tie_word_embeddings, or another rms_norm_eps (large enough to move the loss)
    extra = (', "tie_embeddings": true' if tied else "") + (f', "norm_eps": {eps}' if eps else "")
    model = model_variant(tmp_path, "tiny-llama.json", extra)
    # tp 2 splits the 2 key/value heads one per rank.
    expect_first_step_loss_on_every_layout(tmp_path, model, checkpoint, data, want)


def test_llama_file_with_other_key_value_heads_names_the_tensor_and_both_shapes(tmp_path):
    weights = llama_weights(seed=1, tied=False)
    weights["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(LC, LC)  # 4 kv heads, not 2
    error = refused_init_from(tmp_path, "tiny-llama.json", weights)
    assert ("tensor model.layers.2.self_attn.k_proj.weight has shape [32, 32]; the model needs "
            "[16, 32]") in error


def test_a_gpt2_file_for_a_llama_model_says_which_names_it_needs(tmp_path):
    error = refused_init_from(tmp_path, "tiny-llama.json", gpt2_weights(seed=2, tied=False))
    assert ("the file has GPT-2's tensor names (wte.weight), but the model's block is Llama's"
            in error)
