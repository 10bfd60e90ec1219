"""Hugging Face model directories into pipec and piperun, checked against transformers itself:
a GPT-2, a Llama (grouped-query attention) and a Mistral model built by transformers and saved
by its save_pretrained (config.json and sharded safetensors with model.safetensors.index.json),
`pipec spec --from-hf` makes the model spec from the config, and `piperun --init-from DIR`'s
first-step loss equals the loss transformers computes with the same weights on the same tokens.
A config that disagrees with the spec, and directories the reader must refuse, exit 2 with one
line."""

import json
import re
import subprocess

import pytest

from conftest import pipec_binary, run_pipec
from test_init_from import piperun_binary

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, T = 64, 16


def build(kind: str, tied: bool):
    """A small causal LM of `kind` with weights large enough that the loss depends on them."""
    common = dict(vocab_size=V, tie_word_embeddings=tied)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, n_positions=32,
                                         **common)
    elif kind == "llama":
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=96,
                                          num_hidden_layers=4, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=64,
                                          rope_theta=500000.0, rms_norm_eps=1e-5, **common)
    else:
        config = transformers.MistralConfig(hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=4, num_attention_heads=4,
                                            num_key_value_heads=2, max_position_embeddings=64,
                                            sliding_window=32, rms_norm_eps=1e-6, **common)
    config._attn_implementation = "eager"
    torch.manual_seed({"gpt2": 1, "llama": 2, "mistral": 3}[kind] + 10 * tied)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm scales (and GPT-2's shifts and biases)
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    model.eval()
    return model


def hf_loss(model, tokens: list) -> float:
    """Mean next-token cross-entropy of one sequence, computed by transformers in float64."""
    m = model.double()
    with torch.no_grad():
        logits = m(torch.tensor([tokens[:-1]])).logits[0]
    m.float()
    return torch.nn.functional.cross_entropy(logits, torch.tensor(tokens[1:])).item()


def spec_from(directory, tmp_path) -> str:
    spec = tmp_path / "spec.json"
    r = run_pipec("spec", "--from-hf", str(directory / "config.json"), "--seq-length", str(T),
                  "--microbatch-size", "2", "-o", str(spec))
    assert r.returncode == 0, r.stderr
    text = json.loads(spec.read_text())
    text["transformer"]["dtype"] = "fp32"  # piperun's cpu backend is the fp32 reference
    spec.write_text(json.dumps(text))
    return str(spec)


def first_step_loss(tmp_path, spec: str, directory, data, layout: str) -> float:
    plan = tmp_path / "plan.json"
    c = subprocess.run([pipec_binary(), "compile", "--quiet", "--model", spec, *layout.split(),
                        "-o", str(plan)], capture_output=True, text=True)
    assert c.returncode == 0, c.stderr
    r = subprocess.run([piperun_binary(), str(plan), "--backend", "cpu", "--steps", "1",
                        "--data", str(data), "--init-from", str(directory)],
                       capture_output=True, text=True)
    assert r.returncode == 0, layout + "\n" + r.stdout + r.stderr
    return float(re.search(r"step 0 loss (\S+)", r.stdout).group(1))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral"])
@pytest.mark.parametrize("tied", [False, True])
def test_sharded_directory_gives_transformers_loss(tmp_path, kind, tied):
    model = build(kind, tied)
    directory = tmp_path / "model"
    model.save_pretrained(directory, max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").exists()
    assert len(list(directory.glob("model-*-of-*.safetensors"))) > 1
    # A token file of exactly one sequence (T + 1 ids): every window of every step is it.
    tokens = torch.randint(0, V, (T + 1,), generator=torch.Generator().manual_seed(7)).tolist()
    data = tmp_path / "tokens.bin"
    data.write_bytes(b"".join(t.to_bytes(2, "little") for t in tokens))
    want = hf_loss(model, tokens)
    spec = spec_from(directory, tmp_path)
    for layout in ["--schedule 1f1b --pp 2 --microbatches 4",
                   "--schedule zb-v --pp 2 --vpp 2 --microbatches 2 --tp 2"]:
        got = first_step_loss(tmp_path, spec, directory, data, layout)
        assert got == pytest.approx(want, abs=2e-5), (layout, got, want)


def test_unsharded_directory_loads_too(tmp_path):
    model = build("llama", tied=False)
    directory = tmp_path / "model"
    model.save_pretrained(directory)
    assert (directory / "model.safetensors").exists()
    tokens = list(range(T + 1))
    data = tmp_path / "tokens.bin"
    data.write_bytes(b"".join(t.to_bytes(2, "little") for t in tokens))
    got = first_step_loss(tmp_path, spec_from(directory, tmp_path), directory, data,
                          "--schedule 1f1b --pp 2 --microbatches 2")
    assert got == pytest.approx(hf_loss(model, tokens), abs=2e-5)


def refused(tmp_path, spec: str, directory) -> str:
    plan = tmp_path / "plan.json"
    subprocess.run([pipec_binary(), "compile", "--quiet", "--model", spec, "--schedule", "1f1b",
                    "--pp", "2", "--microbatches", "2", "-o", str(plan)], check=True)
    r = subprocess.run([piperun_binary(), str(plan), "--backend", "cpu", "--init-from",
                        str(directory)], capture_output=True, text=True)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert "step 0" not in r.stdout
    return r.stderr


@pytest.mark.parametrize("field, value, message", [
    ("num_attention_heads", 8,
     "num_attention_heads is 4 but the model spec's num_attention_heads is 8"),
    ("rope_theta", 10000.0, "rope_theta is 500000 but the model spec's rope_theta is 10000"),
    ("norm_eps", 1e-6, "rms_norm_eps is 1e-05 but the model spec's norm_eps is 1e-06"),
    ("num_query_groups", 4, "num_key_value_heads is 2 but the model spec's num_query_groups is 4"),
    ("tie_embeddings", True,
     "tie_word_embeddings is false but the model spec's tie_embeddings is true"),
])
def test_a_spec_that_disagrees_with_config_json_is_refused_naming_both(tmp_path, field, value,
                                                                        message):
    directory = tmp_path / "model"
    build("llama", tied=False).save_pretrained(directory, max_shard_size="20KB")
    spec = json.loads(open(spec_from(directory, tmp_path)).read())
    spec["transformer"][field] = value
    path = tmp_path / "wrong.json"
    path.write_text(json.dumps(spec))
    assert message in refused(tmp_path, str(path), directory)


def test_index_and_shards_that_disagree_are_refused(tmp_path):
    directory = tmp_path / "model"
    build("gpt2", tied=True).save_pretrained(directory, max_shard_size="20KB")
    spec = spec_from(directory, tmp_path)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    names = sorted(index["weight_map"])
    # A tensor the map puts in another shard than the one holding it.
    shards = sorted(set(index["weight_map"].values()))
    moved = dict(index)
    moved["weight_map"] = dict(index["weight_map"])
    victim = names[0]
    moved["weight_map"][victim] = next(s for s in shards if s != index["weight_map"][victim])
    index_path.write_text(json.dumps(moved))
    assert f"tensor {victim} is said to be in" in refused(tmp_path, spec, directory)
    # A shard outside the directory.
    escape = dict(index)
    escape["weight_map"] = dict(index["weight_map"], **{victim: "../elsewhere.safetensors"})
    index_path.write_text(json.dumps(escape))
    assert "expected the name of a shard file in the directory" in refused(tmp_path, spec,
                                                                          directory)
    # No config.json.
    index_path.write_text(json.dumps(index))
    (directory / "config.json").unlink()
    assert "no config.json" in refused(tmp_path, spec, directory)


def test_spec_from_hf_refuses_what_the_kernels_do_not_compute(tmp_path):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, vocab_size=V,
                                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    path = tmp_path / "config.json"
    config.to_json_file(path)
    r = run_pipec("spec", "--from-hf", str(path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "rope" in r.stderr and "not supported" in r.stderr, r.stderr
    qwen = tmp_path / "qwen" / "config.json"
    qwen.parent.mkdir()
    transformers.Qwen2Config(vocab_size=V).to_json_file(qwen)
    r = run_pipec("spec", "--from-hf", str(qwen))
    assert r.returncode == 2 and "model_type: \"qwen2\" is not one pipec runs" in r.stderr


def test_a_config_key_given_twice_means_to_pipec_what_it_means_to_transformers(tmp_path):
    # pipec's own formats refuse a key given twice; config.json is read as transformers reads
    # it (Python's json keeps the last), so both build the same model from it.
    path = tmp_path / "config.json"
    transformers.GPT2Config(n_layer=4, n_embd=32, n_head=4, n_positions=32,
                            vocab_size=V).to_json_file(path)
    text = path.read_text()
    assert text.count('"n_layer": 4') == 1
    path.write_text(text.replace('"n_layer": 4', '"n_layer": 3, "n_layer": 6'))
    assert transformers.AutoConfig.from_pretrained(tmp_path).n_layer == 6
    r = run_pipec("spec", "--from-hf", str(path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["transformer"]["num_layers"] == 6, r.stdout


def rewrite(path, edit):
    """Rewrite a safetensors file: `edit(header_text, data) -> (header_text, data)`."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = edit(raw[8:8 + n].decode(), raw[8 + n:])
    blob = header.encode()
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)


def rewrite_header(path) -> str:
    raw = path.read_bytes()
    return raw[8:8 + int.from_bytes(raw[:8], "little")].decode()


def shift(header: str, name: str, begin: int, end: int) -> str:
    h = json.loads(header)
    h[name]["data_offsets"] = [begin, end]
    return json.dumps(h)


# Two entries of one name: the reference library (safetensors 0.8) keeps the last one silently;
# piperun refuses the file, since the two may describe different data. Every other case the
# reference library refuses too (a header padded with NULs rather than spaces, metadata that is
# not strings among them).
@pytest.mark.parametrize("case, edit, message", [
    ("duplicate", lambda h, d: (h.replace('"a":', '"b": {"dtype": "F32", "shape": [4], '
                                          '"data_offsets": [0, 16]}, "a":', 1), d),
     "tensor b appears twice in the header"),
    ("overlap", lambda h, d: (shift(h, "b", 8, 24), d), "tensors a and b overlap"),
    ("gap", lambda h, d: (shift(shift(h, "b", 20, 36), "a", 0, 16), d + b"\0" * 4),
     "data bytes [16, 20) before tensor b belong to no tensor"),
    ("trailing", lambda h, d: (h, d + b"\0" * 8), "the last 8 bytes of data belong to no tensor"),
    ("nul-padding", lambda h, d: (h + "\0" * 4, d), "its header holds a NUL byte at offset"),
    ("metadata", lambda h, d: (json.dumps(dict(json.loads(h), __metadata__={"format": 1})), d),
     "__metadata__: expected an object of strings"),
])
def test_safetensors_the_reference_library_refuses_are_refused(tmp_path, case, edit, message):
    st = pytest.importorskip("safetensors")
    st_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "model.safetensors"
    st_torch.save_file({"a": torch.zeros(4), "b": torch.ones(4)}, str(path),
                       metadata={"format": "pt"})
    rewrite(path, edit)
    if case == "duplicate":
        assert rewrite_header(path).count('"b":') == 2
    else:
        with pytest.raises(Exception):  # the reference library refuses the file
            with st.safe_open(str(path), framework="pt") as f:
                [f.get_tensor(k) for k in f.keys()]
    plan = tmp_path / "plan.json"
    subprocess.run([pipec_binary(), "compile", "--quiet", "--model",
                    str(__import__("conftest").example("tiny-gpt.json")), "--schedule", "1f1b",
                    "--pp", "2", "--microbatches", "2", "-o", str(plan)], check=True)
    r = subprocess.run([piperun_binary(), str(plan), "--backend", "cpu", "--init-from",
                        str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert message in r.stderr, r.stderr


def tiny_spec(tmp_path, llama: bool, tied: bool) -> str:
    """examples/tiny-gpt.json or tiny-llama.json in fp32, tied or not."""
    spec = json.loads(open(__import__("conftest").example(
        "tiny-llama.json" if llama else "tiny-gpt.json")).read())
    spec["transformer"]["dtype"] = "fp32"
    spec["transformer"]["tie_embeddings"] = tied
    path = tmp_path / f"spec-{llama}-{tied}.json"
    path.write_text(json.dumps(spec))
    return str(path)


@pytest.mark.parametrize("llama", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_export_hf_after_tp2_pp2_training_loads_in_transformers(tmp_path, llama, tied):
    spec = tiny_spec(tmp_path, llama, tied)
    seq = json.loads(open(spec).read())["transformer"]["seq_length"]
    plan = tmp_path / "plan.json"
    r = run_pipec("compile", "--quiet", "--model", spec, "--schedule", "1f1b", "--pp", "2",
                  "--tp", "2", "--microbatches", "4", "-o", str(plan))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "trained"
    r = subprocess.run([piperun_binary(), str(plan), "--backend", "cpu", "--steps", "3",
                        "--lr", "1e-2", "--export-hf", str(out), "--export-hf-shard-size",
                        "16KB"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"exported the weights to {out}" in r.stdout
    assert (out / "model.safetensors.index.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(model).__name__ == ("LlamaForCausalLM" if llama else "GPT2LMHeadModel")
    # The trained weights computed by transformers and by piperun (--init-from the export, one
    # step on a file of exactly one sequence): the same loss.
    tokens = torch.randint(0, model.config.vocab_size, (seq + 1,),
                           generator=torch.Generator().manual_seed(5)).tolist()
    data = tmp_path / "tokens.bin"
    data.write_bytes(b"".join(t.to_bytes(2, "little") for t in tokens))
    r = subprocess.run([piperun_binary(), str(plan), "--backend", "cpu", "--steps", "1",
                        "--data", str(data), "--init-from", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    got = float(re.search(r"step 0 loss (\S+)", r.stdout).group(1))
    assert got == pytest.approx(hf_loss(model, tokens), abs=2e-5)
    # And they are the trained weights, not the initial ones.
    r = subprocess.run([piperun_binary(), str(plan), "--backend", "cpu", "--steps", "1",
                        "--data", str(data)], capture_output=True, text=True)
    seeded = float(re.search(r"step 0 loss (\S+)", r.stdout).group(1))
    assert abs(seeded - got) > 1e-3


def test_export_hf_refuses_a_directory_of_files_before_training(tmp_path):
    plan = tmp_path / "plan.json"
    run_pipec("compile", "--quiet", "--model", tiny_spec(tmp_path, False, False), "--schedule",
              "1f1b", "--pp", "2", "--microbatches", "2", "-o", str(plan))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    r = subprocess.run([piperun_binary(), str(plan), "--backend", "cpu", "--export-hf",
                        str(busy)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "exists and is not empty" in r.stderr and "step 0" not in r.stdout
    assert (busy / "keep.txt").read_text() == "mine"


def test_spec_names_the_model_by_its_directory_even_from_inside_it(tmp_path):
    # `pipec spec --from-hf config.json` run in the config's directory named the model by its
    # model_type ("llama"), not the directory as docs/commands.md says; --name "" was ignored.
    folder = tmp_path / "tiny-llama-dir"
    folder.mkdir()
    transformers.LlamaConfig(hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, vocab_size=V).to_json_file(folder / "config.json")
    for cwd, path in [(tmp_path, str(folder / "config.json")), (folder, "config.json")]:
        r = subprocess.run([pipec_binary(), "spec", "--from-hf", path], capture_output=True,
                           text=True, check=False, cwd=cwd)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["name"] == "tiny-llama-dir"
    r = run_pipec("spec", "--from-hf", str(folder / "config.json"), "--name", "")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--name: expected a name, got an empty one" in r.stderr
