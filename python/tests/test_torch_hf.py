"""Hugging Face models under pipec plans in PyTorch (pipec.torch.hf_layers, model_spec,
PipelineRunner's tied embeddings): a transformers GPT2LMHeadModel and LlamaForCausalLM
(grouped-query attention, rotary positions), and MistralForCausalLM on three schedules, tied and
untied, in eager attention (causal only
through the mask hf_layers passes), trained one step under six schedules on 2 and 4 real gloo
processes; every gradient equals the unsplit transformers model's within 1e-5 of the largest
gradient, and the losses agree. One case trains 20 steps and its loss falls."""

import functools
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import hf_workers  # noqa: E402
import pipec  # noqa: E402
import pipec.torch  # noqa: E402
from conftest import ROOT, example, run_ranks  # noqa: E402

WORLDS = (2, 4)
FAMILIES = ("gpt2", "llama")


def _cases():
    cases = [{"id": f"{family}-{'tied' if tied else 'untied'}-{name}", "family": family,
              "tied": tied, "schedule": name, "flags": flags}
             for family in FAMILIES for tied in (False, True)
             for name, flags in hf_workers.SCHEDULES]
    # Mistral: Llama's decoder layers under another model class, on three schedules.
    cases += [{"id": f"mistral-{'tied' if tied else 'untied'}-{name}", "family": "mistral",
               "tied": tied, "schedule": name, "flags": flags}
              for tied in (False, True) for name, flags in hf_workers.SCHEDULES
              if name in ("1f1b", "zb-v", "dualpipe-v")]
    return cases


def _spawn(work, world, cases, train_steps):
    run_ranks(hf_workers.run_cases,
              world, (world, str(work / "rendezvous"), str(work), cases, train_steps))
    return {case["id"]: [torch.load(work / f"{case['id']}-rank{r}.pt") for r in range(world)]
            for case in cases}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case on 2 and on 4 real processes (one fork per world size)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = {}
    for world in WORLDS:
        for case_id, parts in _spawn(tmp_path_factory.mktemp(f"hf{world}"), world, _cases(),
                                     0).items():
            out[(world, case_id)] = parts
    return out


@functools.lru_cache(maxsize=None)
def _reference(family: str, tied: bool, microbatches: int):
    """The unsplit transformers model (its own causal mask and rotary positions): the mean of
    the microbatch losses, backward, every parameter's gradient by name. Computed once per
    model and microbatch count (seconds each), shared by the six schedules' cases: read only."""
    model = hf_workers.build(family, tied)
    tokens, targets = hf_workers.batch(microbatches)
    losses = [hf_workers.loss_fn(model(x).logits, y) for x, y in
              zip(tokens.tensor_split(microbatches), targets.tensor_split(microbatches))]
    torch.stack(losses).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    return grads, [x.item() for x in losses]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", [c["id"] for c in _cases()])
def test_gradients_equal_the_unsplit_transformers_model(runs, world, case):
    family, tied = case.split("-")[0], case.split("-")[1] == "tied"
    parts = runs[(world, case)]
    want, want_losses = _reference(family, tied, 2 * world)
    grads = {}
    for part in parts:
        for name, g in part["grads"].items():
            assert name not in grads, f"{name} on two ranks"
            grads[name] = g
    assert set(grads) == set(want)
    scale = max(g.abs().max().item() for g in want.values())
    worst, where = max(((grads[k] - want[k]).abs().max().item(), k) for k in want)
    assert worst <= 1e-5 * scale, f"{where}: difference {worst:.3g}, scale {scale:.3g}"
    losses = [p["losses"] for p in parts if p["losses"]]
    assert len(losses) == 1 and losses[0][0] == pytest.approx(
        sum(want_losses) / len(want_losses), rel=1e-5)


def test_loss_falls_over_20_steps_with_tied_embeddings_on_a_v_shape(tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    case = {"id": "llama-tied-zb-v-train", "family": "llama", "tied": True, "schedule": "zb-v",
            "flags": {"vpp": 2}}
    parts = _spawn(tmp_path, 2, [case], 20)[case["id"]]
    history = next(p["losses"] for p in parts if p["losses"])
    assert len(history) == 20
    assert history[-1] < 0.5 * history[0], history
    # zb-v puts the embedding and the head on rank 0: their two copies stayed equal.
    assert parts[0]["tied_gap"] == 0.0


def test_model_spec_matches_what_hf_layers_cuts():
    model = hf_workers.build("llama", tied=True)
    spec = pipec.torch.model_spec(model.config, seq_length=16)
    t = spec["transformer"]
    assert (t["num_layers"], t["hidden_size"], t["num_query_groups"], t["tie_embeddings"]) == (
        6, 32, 2, True)
    assert len(pipec.torch.hf_layers(model)) == t["num_layers"] + 2
    with pytest.raises(ValueError, match="rope_scaling"):
        pipec.torch.model_spec(dict(model.config.to_dict(), rope_scaling={"rope_type": "yarn"}))
    with pytest.raises(ValueError, match="not a GPT-2 or Llama-family causal LM"):
        pipec.torch.hf_layers(torch.nn.Linear(2, 2))


def test_model_spec_reads_a_config_file_by_the_input_rules(tmp_path):
    # A path goes through `pipec spec --from-hf`'s reader (it was Python's open(): a directory
    # raised IsADirectoryError, /dev/zero was read, a long file cut and called malformed), and
    # the numbers take the command's bounds (pybind's generic TypeError past 64 bits).
    config = hf_workers.build("llama", tied=True).config.to_dict()
    folder = tmp_path / "my-llama"
    folder.mkdir()
    (folder / "config.json").write_text(__import__("json").dumps(config))
    spec = pipec.torch.model_spec(folder / "config.json", seq_length=16)
    assert spec["name"] == "my-llama"  # the directory's name, as `pipec spec` gives it
    assert spec == pipec.torch.model_spec(str(folder / "config.json"), seq_length=16)
    for path, message in [(tmp_path, "is a directory"), ("/dev/zero", "a character device"),
                          (tmp_path / "missing.json", "cannot read")]:
        with pytest.raises(ValueError, match=message):
            pipec.torch.model_spec(path)
    for flags, message in [({"microbatch_size": 100000}, r"microbatch_size: expected an integer"),
                           ({"seq_length": 2**70}, r"seq_length: expected an integer"),
                           ({"name": "a\0b"}, "name: cannot hold a NUL")]:
        with pytest.raises(ValueError, match=message):
            pipec.torch.model_spec(config, **flags)
    with pytest.raises(TypeError, match="name: expected a str"):
        pipec.torch.model_spec(config, name=5)


def test_the_example_trains_a_hugging_face_llama_from_its_config():
    r = subprocess.run([sys.executable, example("hf_llama.py"), "--pp", "2", "--steps", "6"],
                       capture_output=True, text=True, check=False, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(line.split("loss ")[1]) for line in r.stdout.splitlines()
              if line.startswith("step")]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, r.stdout
