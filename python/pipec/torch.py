"""Train your own per-stage ``nn.Module``s under a pipec plan, with PyTorch's pipelining runtime.

A pipec plan fixes the stages (which layers each holds, which rank runs it), the order of every
rank's compute, and, in the compute+comms form, the order of every send and receive, proven
deadlock-free and FIFO-matched. This module hands that order to PyTorch's own runtime
(``torch.distributed.pipelining``), so the same plan that pipec verified and simulated is what
trains your model:

    import pipec, pipec.torch
    plan = pipec.compile("model.json", "zb-auto", pp=4, microbatches=8, memory_limit="6GiB")
    stages = pipec.torch.stage_modules(plan, layers)  # layers: one nn.Module per model layer
    pipe = pipec.torch.PipelineRunner(plan, stages, loss_fn)
    losses = []
    pipe.step(tokens, target=targets, losses=losses)  # then optimizer.step() as usual

Run it in every process of a ``torch.distributed`` group of ``plan.pp`` ranks (torchrun, or
``torch.multiprocessing``; gloo on CPU, NCCL on GPUs). Pinned: PyTorch 2.15.0. Private PyTorch
APIs used: ``torch.distributed.pipelining.schedules._PipelineScheduleRuntime`` and its
``_load_csv`` (with ``format="compute_comms"`` or ``"compute_only"``).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

import pipec
from pipec.hf import hf_layers, model_spec, tied_pairs

__all__ = ["PipelineRunner", "hf_layers", "local_stages", "model_spec", "profile",
           "stage_modules", "tied_pairs"]

#: The PyTorch version the CSV spelling and the private APIs were checked against.
PINNED_TORCH = "2.15.0"


def stage_modules(plan, layers: Sequence[nn.Module]) -> list[nn.Module]:
    """Cut a model's layers into the plan's stages: stage s becomes ``nn.Sequential`` of
    ``layers[b:e]`` for the stage's layer range [b, e) (pipec's partition of the model JSON's
    layers; for a transformer model those are the embedding, the blocks, then the head).

    The modules are shared, not copied: a layer's parameters are the same tensors."""
    plan = pipec._as_plan(plan)
    layers = _modules("layers", layers)
    end = plan.stages[-1]["layers"][1]
    if len(layers) != end:
        raise ValueError(f"layers: the plan's model has {end} layers (stages cover [0, {end})) "
                         f"but {len(layers)} modules were given; give one module per layer")
    return [nn.Sequential(*layers[s["layers"][0]:s["layers"][1]]) for s in plan.stages]


def _modules(what: str, value) -> list:
    """`value` as a list of nn.Module (None allowed where `what` is "modules"); TypeError naming
    the argument for anything else."""
    if isinstance(value, (str, bytes, nn.Module)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{what}: expected a sequence of torch.nn.Module "
                        f"(got {type(value).__name__})")
    out = list(value)
    for i, m in enumerate(out):
        if not isinstance(m, nn.Module) and not (m is None and what == "modules"):
            raise TypeError(f"{what}[{i}]: expected a torch.nn.Module (got {type(m).__name__})")
    return out


def local_stages(plan, rank: int) -> list[int]:
    """The stages the plan puts on pipeline rank `rank`, in stage order."""
    plan = pipec._as_plan(plan)
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank: expected an int (got {type(rank).__name__})")
    return [s["stage"] for s in plan.stages if s["rank"] == rank]


class PipelineRunner:
    """Runs training steps of the user's stage modules under a pipec plan's schedule.

    plan: a pipec.Plan or the path of a plan JSON (its pp must be the group's size); verified
        first, as `pipec validate` does: pipec.PlanError before anything runs if it is wrong.
    modules: every stage's module (a sequence of plan.num_stages, where other ranks' entries may
        be None) or a mapping {stage index: module} holding at least this rank's stages.
    loss_fn: loss_fn(output, target) -> scalar, on the last stage's microbatch output; with
        scale_grads (the default) gradients are divided by the number of microbatches, so a
        mean loss per microbatch gives the gradient of the mean over the batch.
    group: the pipeline's process group (default: the whole world); pipeline rank = group rank.
    device: where the modules live (default: CPU).
    comms: True runs pipec's own send/recv order (the torch-csv-comms form, loaded with
        format="compute_comms"); False gives PyTorch only the compute order (torch-csv) and
        lets it derive the communication itself.
    """

    def __init__(self, plan, modules: Sequence[nn.Module | None] | Mapping[int, nn.Module],
                 loss_fn: Callable[..., torch.Tensor], *, group=None,
                 device: torch.device | str | None = None, comms: bool = True,
                 scale_grads: bool = True):
        self.plan = pipec._as_plan(plan)
        # A plan file is checked before anything runs (pipec.PlanError with the diagnostic
        # otherwise): its streams must be dependency-respecting, FIFO-matched, deadlock-free.
        pipec.validate(self.plan)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("pipec.torch needs torch.distributed initialised in every "
                               f"process of the pipeline ({self.plan.pp} ranks), e.g. "
                               "dist.init_process_group('gloo') under torchrun")
        size = dist.get_world_size(group)
        if size != self.plan.pp:
            raise ValueError(f"the plan has pp={self.plan.pp} but the process group has {size} "
                             f"ranks; run {self.plan.pp} processes, or compile with --pp {size}")
        self.rank = dist.get_rank(group)
        try:
            self.device = torch.device(device) if device is not None else torch.device("cpu")
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device: {err}") from None
        if not callable(loss_fn):
            raise TypeError(f"loss_fn: expected a callable (got {type(loss_fn).__name__})")
        num_stages = self.plan.num_stages
        mine = local_stages(self.plan, self.rank)
        if isinstance(modules, Mapping):
            for s, m in modules.items():
                if m is not None and not isinstance(m, nn.Module):
                    raise TypeError(f"modules[{s!r}]: expected a torch.nn.Module "
                                    f"(got {type(m).__name__})")
            missing = [s for s in mine if modules.get(s) is None]
        else:
            modules = _modules("modules", modules)
            if len(modules) != num_stages:
                raise ValueError(f"modules: the plan has {num_stages} stages but {len(modules)} "
                                 "modules were given (or pass a dict {stage: module})")
            missing = [s for s in mine if modules[s] is None]
        if missing:
            raise ValueError(f"modules: rank {self.rank} runs stages {mine} but has no module for "
                             f"stage {missing[0]}")
        # Checks that PyTorch can express the plan (exit 2's line as ValueError otherwise).
        # Tied embeddings are summed by this runner after each step (_sum_tied_gradients), so
        # the CSV leaves their all-reduce out.
        csv = self.plan._h.torch_csv(bool(comms), tied_by_caller=True)
        # PyTorch's runtime hands the last stage's backward the loss of the k-th forward it ran
        # as microbatch k's: the plan must run that stage's forwards in microbatch order.
        last = num_stages - 1
        owner = self.plan.stages[last]["rank"]
        order = [i["mb"] for i in self.plan.instructions(owner)
                 if i["op"] == "forward" and i["stage"] == last]
        if order != sorted(order):
            raise ValueError(f"PyTorch's runtime pairs losses with microbatches in the order the "
                             f"last stage runs its forwards, but this plan runs them as {order}; "
                             "use a schedule whose last stage runs microbatches in order")
        self.csv = csv
        self.stages = [
            PipelineStage(modules[s].to(self.device), s, num_stages, self.device, group=group)
            for s in mine
        ]
        self.schedule = _PipelineScheduleRuntime(
            self.stages, n_microbatches=self.plan.microbatches, loss_fn=loss_fn,
            scale_grads=scale_grads)
        fd, path = tempfile.mkstemp(prefix="pipec-", suffix=".csv")
        try:
            with os.fdopen(fd, "w", newline="") as f:
                f.write(csv)
            self.schedule._load_csv(path, format="compute_comms" if comms else "compute_only")
        finally:
            os.unlink(path)
        # PyTorch infers where each stage runs from the rows; it must be the plan's placement.
        placed = dict(self.schedule.stage_index_to_group_rank)
        want = {s["stage"]: s["rank"] for s in self.plan.stages}
        if placed != want:
            raise RuntimeError(f"PyTorch placed the stages as {placed}, the plan as {want}")
        self._tie(modules, mine, group)

    def _peer(self, rank: int) -> int:
        """The global rank of pipeline rank `rank` (what send and recv take)."""
        return rank if self._group is None else dist.get_global_rank(self._group, rank)

    def _tie(self, modules, mine, group) -> None:
        """Tied embeddings (pipec.torch.hf_layers marks them): the embedding's parameter on
        the first stage's rank and the head's on the last stage's, found on every rank and
        agreed by all (so that a half-marked pair is an error, not a hang); the head starts
        from the embedding's value."""
        self._group = group
        held = tied_pairs(modules[s] for s in mine)
        flags = torch.tensor([float("embedding" in held), float("head" in held)])
        dist.all_reduce(flags, group=group)
        self._tied = held
        self._tie_ranks = (self.plan.stages[0]["rank"], self.plan.stages[-1]["rank"])
        plan_ties = any(i["op"] == "all_reduce" and i.get("group") == "embedding"
                        for i in self.plan.instructions(self._tie_ranks[0]))
        if flags.sum() == 0:
            if plan_ties:
                raise ValueError("the plan ties the input and output embeddings, but no module "
                                 "marks the tied pair: build the layers with "
                                 "pipec.torch.hf_layers, or compile a model with "
                                 "\"tie_embeddings\": false")
            self._tied = None
            return
        if flags.tolist() != [1.0, 1.0]:
            raise ValueError("modules: a tied embedding's two parameters must be on the first "
                             "stage (the embedding) and the last (the head); found "
                             f"{int(flags[0])} embedding and {int(flags[1])} head parameters")
        first, last = self._tie_ranks
        emb, head = held.get("embedding"), held.get("head")
        with torch.no_grad():
            if self.rank not in (first, last):
                return
            if first == last:
                head.copy_(emb)
            elif self.rank == first:
                dist.send(emb.detach().contiguous(), dst=self._peer(last), group=group)
            elif self.rank == last:
                buf = torch.empty_like(head)
                dist.recv(buf, src=self._peer(first), group=group)
                head.copy_(buf)

    def _sum_tied_gradients(self) -> None:
        """After a step: the embedding's and the head's gradients both become their sum, as
        one shared matrix's would be (each was scaled by the microbatch count once)."""
        if self._tied is None:
            return
        first, last = self._tie_ranks
        if self.rank not in (first, last):
            return
        mine = [p for p in self._tied.values()]
        for p in mine:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if first == last:
            total = mine[0].grad + mine[1].grad
            for p in mine:
                p.grad.copy_(total)
            return
        own = mine[0].grad
        other = torch.empty_like(own)
        peer = self._peer(last if self.rank == first else first)
        ops = [dist.P2POp(dist.isend, own.contiguous(), peer, self._group),
               dist.P2POp(dist.irecv, other, peer, self._group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        own.add_(other)

    def step(self, *args, target=None, losses: list | None = None, **kwargs):
        """One training step over plan.microbatches microbatches (the batch is split along
        dimension 0). Inputs matter on the rank of the first stage, target on the rank of the
        last (pass both everywhere if that is simpler); per-microbatch losses are appended to
        `losses` on the last stage's rank. Returns the merged output there, None elsewhere."""
        out = self.schedule.step(*args, target=target, losses=losses, **kwargs)
        self._sum_tied_gradients()
        return out

    @property
    def has_last_stage(self) -> bool:
        return any(st.is_last for st in self.stages)

    @property
    def has_first_stage(self) -> bool:
        return any(st.is_first for st in self.stages)


def _quartiles(ms: list[float]) -> tuple[float, float]:
    """Median and interquartile range (linear interpolation, as pipecost/1's C++ side)."""
    ms = sorted(ms)

    def q(p):
        at = p * (len(ms) - 1)
        lo = int(at)
        hi = min(lo + 1, len(ms) - 1)
        return ms[lo] + (ms[hi] - ms[lo]) * (at - lo)

    return q(0.5), q(0.75) - q(0.25)


def profile(plan, modules, example, loss_fn, target, path, *, steps: int = 5, group=None,
            device: torch.device | str | None = None) -> dict | None:
    """Measure the user's own stage modules under PyTorch and write measured costs (pipecost/1,
    the format `piperun --profile` writes) for `pipec compile ... --costs`, so that zb-auto's
    order (and every other schedule's timing) is fitted to this model.

    Run it in every process of the pipeline's group, as PipelineRunner. Each rank times its
    stages' forward (the last stage's with loss_fn) and backward (fused: an nn.Module's backward
    computes input and weight gradients together; the compiler splits it in the model's ratio)
    on one microbatch, `steps` times, the first dropped as warm-up. A stage's input is the
    previous stage's output on `example` (the first stage's microbatch input), passed on between
    the ranks; its backward is fed a gradient of its output's shape. Rank 0 writes `path`
    through the C++ writer (which checks every field first) and returns the costs as a dict;
    the other ranks return None. Messages, collectives and the optimizer are not measured here
    (the model's times stay for those); the plan must have one sub-sequence.
    """
    plan = pipec._as_plan(plan)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise ValueError(f"steps: expected an integer of at least 2 (got {steps!r}); the first "
                         "step is dropped as warm-up")
    if plan.seq_splits != 1:
        raise ValueError(f"the plan has seq_splits={plan.seq_splits}; pipec.torch.profile "
                         "measures whole-sequence stages (compile with seq_splits=1)")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable (got {type(loss_fn).__name__})")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("pipec.torch.profile needs torch.distributed initialised in every "
                           f"process of the pipeline ({plan.pp} ranks)")
    size = dist.get_world_size(group)
    if size != plan.pp:
        raise ValueError(f"the plan has pp={plan.pp} but the process group has {size} ranks")
    rank = dist.get_rank(group)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    num_stages = plan.num_stages
    mine = local_stages(plan, rank)
    if isinstance(modules, Mapping):
        get = modules.get
    else:
        modules = _modules("modules", modules)
        if len(modules) != num_stages:
            raise ValueError(f"modules: the plan has {num_stages} stages but {len(modules)} "
                             "modules were given (or pass a dict {stage: module})")
        get = lambda s: modules[s]  # noqa: E731
    for s in mine:
        if get(s) is None:
            raise ValueError(f"modules: rank {rank} runs stages {mine} but has no module for "
                             f"stage {s}")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def owner(s):
        return plan.stages[s]["rank"]

    measured = {}
    x = example
    for s in range(num_stages):
        if s > 0 and owner(s) != owner(s - 1):
            # The activation crosses to the next stage's rank (objects: shapes need not be known).
            box = [x.detach().cpu() if rank == owner(s - 1) else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, owner(s - 1))
                                       if group is not None else owner(s - 1), group=group)
            x = box[0]
        if rank != owner(s):
            continue
        module = get(s).to(dev)
        inp = x.to(dev) if isinstance(x, torch.Tensor) else x
        forward, backward = [], []
        out = None
        for _ in range(steps):
            feed = inp
            if isinstance(inp, torch.Tensor) and inp.is_floating_point():
                feed = inp.detach().requires_grad_(True)
            sync()
            t0 = time.perf_counter()
            out = module(feed)
            last = s == num_stages - 1
            if last:
                out = loss_fn(out, target.to(dev) if isinstance(target, torch.Tensor) else target)
            sync()
            t1 = time.perf_counter()
            if last:
                out.backward()
            else:
                out.backward(torch.randn_like(out))
            sync()
            t2 = time.perf_counter()
            forward.append(1e3 * (t1 - t0))
            backward.append(1e3 * (t2 - t1))
            module.zero_grad(set_to_none=True)
        measured[s] = {"forward": forward[1:], "backward": backward[1:]}
        x = out.detach() if s < num_stages - 1 else None
    gathered = [None] * size
    dist.all_gather_object(gathered, measured, group=group)
    if rank != 0:
        return None
    stages = []
    for s in range(num_stages):
        times = next(g[s] for g in gathered if g and s in g)
        ops = []
        for op in ("forward", "backward"):
            median, spread = _quartiles(times[op])
            ops.append({"op": op, "slice": 0, "median_ms": median, "spread_ms": spread,
                        "samples": len(times[op])})
        stages.append({"stage": s, "ops": ops})
    params = [p for s in mine for p in get(s).parameters()]
    costs = {
        "format": "pipecost/1",
        "measured_on": {"backend": "torch", "dtype": str(params[0].dtype).replace("torch.", "")
                        if params else "unknown", "device": str(dev), "plan_hash": "",
                        "threads": size, "steps": steps},
        "slices": 1,
        "stages": stages,
        "messages": [],
        "collectives": [],
        "ranks": [],
    }
    pipec._pipec.write_costs(json.dumps(costs), pipec._path("path", path))
    return costs
