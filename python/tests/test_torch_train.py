"""Item 4: PyTorch's pipelining runtime trains the user's stage modules under pipec plans, on
real processes (gloo on CPU), and the gradients after a step equal a single-process run of the
same model on the same batch within 1e-5 of the largest gradient; the losses agree."""

import functools
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import pipec  # noqa: E402
import pipec.torch  # noqa: E402
import torch_gpt  # noqa: E402
import torch_workers  # noqa: E402
from conftest import ROOT, example, run_ranks  # noqa: E402

# Six blocks: eight layers with the embedding and the head, enough for 4 ranks x 2 chunks.
CFG = {**torch_gpt.CONFIG, "num_layers": 6}
SCHEDULES = [
    ("1f1b", {}),
    ("interleaved-1f1b", {"vpp": 2}),
    ("zb-h1", {}),
    ("zb-v", {"vpp": 2}),
    ("zb-auto", {"memory_limit": "350KiB"}),  # below 1f1b's peak at 2 and 4 ranks
    ("dualpipe-v", {"vpp": 2}),
]
WORLDS = (2, 4)


def _cases(world):
    m = 2 * world  # dualpipe-v needs 2 x pp
    cases = [{"id": f"{name}-comms", "schedule": name, "flags": flags, "microbatches": m,
              "comms": True} for name, flags in SCHEDULES]
    # The compute-only form too (PyTorch derives the comms) for two of them.
    cases += [{"id": f"{name}-compute-only", "schedule": name, "flags": flags, "microbatches": m,
               "comms": False} for name, flags in SCHEDULES if name in ("1f1b", "zb-v")]
    return cases


@functools.lru_cache(maxsize=None)
def _reference(microbatches):
    """One process, no pipeline: the mean of the microbatch losses, backward, gradients. Once
    per microbatch count, shared by every schedule's case: read only."""
    layers = torch_gpt.build_layers(CFG, seed=0)
    model = torch.nn.Sequential(*layers)
    tokens, targets = torch_gpt.batch(CFG, microbatches, step=0)
    losses = [torch_gpt.loss_fn(model(x), y) for x, y in
              zip(tokens.tensor_split(microbatches), targets.tensor_split(microbatches))]
    torch.stack(losses).mean().backward()
    grads = {f"{i}.{n}": p.grad for i, layer in enumerate(layers)
             for n, p in layer.named_parameters()}
    return grads, [x.item() for x in losses]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case on 2 and on 4 real processes (one spawn per world size)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = {}
    for world in WORLDS:
        work = tmp_path_factory.mktemp(f"world{world}")
        cases = _cases(world)
        run_ranks(torch_workers.run_cases, world,
                  (world, str(work / "rendezvous"), str(work), CFG, cases))
        for case in cases:
            parts = [torch.load(work / f"{case['id']}-rank{r}.pt") for r in range(world)]
            out[(world, case["id"])] = parts
    return out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", [c["id"] for c in _cases(2)])
def test_gradients_and_losses_equal_a_single_process_run(runs, world, case):
    parts = runs[(world, case)]
    want_grads, want_losses = _reference(2 * world)
    grads = {}
    for part in parts:
        assert not set(part["grads"]) & set(grads), "a parameter on two ranks"
        grads.update(part["grads"])
    assert set(grads) == set(want_grads)
    scale = max(g.abs().max().item() for g in want_grads.values())
    worst = max((grads[k] - want_grads[k]).abs().max().item() for k in want_grads)
    assert worst <= 1e-5 * scale, f"largest gradient difference {worst:.3g}, scale {scale:.3g}"
    losses = [p["losses"] for p in parts if p["losses"]]
    assert len(losses) == 1, "losses on exactly one rank, the last stage's"
    assert losses[0] == pytest.approx(want_losses, rel=1e-5)


def test_runner_refuses_a_plan_for_another_group_size_or_pytorch_cannot_run(tmp_path):
    import torch.distributed as dist  # noqa: PLC0415
    plan = pipec.compile(torch_gpt.model_spec(CFG), "1f1b", pp=2, microbatches=2)
    stages = pipec.torch.stage_modules(plan, torch_gpt.build_layers(CFG))
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        pipec.torch.PipelineRunner(plan, stages, torch_gpt.loss_fn)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rv'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match="pp=2 but the process group has 1 ranks"):
            pipec.torch.PipelineRunner(plan, stages, torch_gpt.loss_fn)
        tied = torch_gpt.model_spec(CFG)
        tied["transformer"]["tie_embeddings"] = True
        plan = pipec.compile(tied, "zb-v", pp=1, vpp=2, microbatches=2)
        with pytest.raises(ValueError, match="tie_embeddings"):
            pipec.torch.PipelineRunner(plan, pipec.torch.stage_modules(
                plan, torch_gpt.build_layers(CFG)), torch_gpt.loss_fn)
        with pytest.raises(ValueError, match="8 layers .* 3 modules"):
            pipec.torch.stage_modules(plan, torch_gpt.build_layers(CFG)[:3])
    finally:
        dist.destroy_process_group()


def test_the_example_trains_a_gpt_whose_loss_falls():
    r = subprocess.run([sys.executable, example("torch_gpt.py"), "--pp", "2", "--steps", "10"],
                       capture_output=True, text=True, check=False, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(line.split("loss ")[1].split()[0]) for line in r.stdout.splitlines()
              if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 0.3, r.stdout
    assert "zb-auto" in r.stdout.splitlines()[0]
