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
            device: torch.device | str | None = None,
            optimizer: Callable[[list], torch.optim.Optimizer] | None = None) -> dict | None:
    """Measure the user's own stage modules under PyTorch and write measured costs (pipecost/1,
    the format `piperun --profile` writes) for `pipec compile ... --costs`, so that zb-auto's
    order (and every other schedule's timing) is fitted to this model.

    Run it in every process of the pipeline's group, as PipelineRunner. Each rank times its
    stages on one microbatch, `steps` times, the first dropped as warm-up: the forward (the last
    stage's with loss_fn) and the backward. Where a stage's input is a floating-point tensor
    (every stage after the first) the backward is measured twice, fused (input and weight
    gradients, as `backward()` computes them) and for the input gradient alone
    (`torch.autograd.grad` with respect to the input, which skips the weight gradients); the
    weight gradient is their difference, so a zero-bubble schedule gets its B and W measured
    apart. The first stage's backward stays fused (the compiler splits it in the model's ratio).
    A stage's input is the previous stage's output on `example` (the first stage's microbatch
    input), passed on between the ranks; each boundary between two ranks is also timed as half a
    round trip of that tensor (the activation and gradient messages, which have its shape). With
    `optimizer` (a callable from a list of parameters to a torch optimizer, e.g.
    `lambda ps: torch.optim.AdamW(ps)`), each rank also times one optimizer step over its
    stages' parameters (restored afterwards) and reports its peak memory. Rank 0 writes `path`
    through the C++ writer (which checks every field first) and returns the costs as a dict;
    the other ranks return None. Collectives are not measured here (the model's times stay for
    them); the plan must have one sub-sequence.
    """
    inputs = pipec._inputs(plan=plan)  # a plan given by its path: never overwritten
    plan = pipec._as_plan(plan)
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise ValueError(f"steps: expected an integer of at least 2 (got {steps!r}); the first "
                         "step is dropped as warm-up")
    if plan.seq_splits != 1:
        raise ValueError(f"the plan has seq_splits={plan.seq_splits}; pipec.torch.profile "
                         "measures whole-sequence stages (compile with seq_splits=1)")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable (got {type(loss_fn).__name__})")
    if optimizer is not None and not callable(optimizer):
        raise TypeError("optimizer: expected a callable from a list of parameters to a torch "
                        f"optimizer (got {type(optimizer).__name__})")
    # Where the costs go, before anything is measured: never onto the plan file it was given.
    pipec._pipec.check_output("path", pipec._path("path", path), inputs)
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

    def timed(fn):
        """fn()'s result and its time in ms, the device synchronised on both sides."""
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        result = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return result, 1e3 * (time.perf_counter() - t0)

    def owner(s):
        return plan.stages[s]["rank"]

    def global_rank(r):
        return dist.get_global_rank(group, r) if group is not None else r

    output_bytes = [st["output_bytes"][0] for st in plan.to_dict()["stages"]]
    measured = {"stages": {}, "messages": [], "optimizer": []}
    x = example
    for s in range(num_stages):
        if s > 0 and owner(s) != owner(s - 1):
            # The activation crosses to the next stage's rank (objects: shapes need not be known).
            box = [x.detach().cpu() if rank == owner(s - 1) else None]
            dist.broadcast_object_list(box, src=global_rank(owner(s - 1)), group=group)
            x = box[0]
            if rank in (owner(s - 1), owner(s)) and isinstance(x, torch.Tensor):
                measured["messages"].append(
                    {"bytes": output_bytes[s - 1],
                     "ms": _round_trips(x, rank == owner(s - 1),
                                        global_rank(owner(s if rank == owner(s - 1) else s - 1)),
                                        steps, group, dev)})
        if rank != owner(s):
            continue
        module = get(s).to(dev)
        inp = x.to(dev) if isinstance(x, torch.Tensor) else x
        split = isinstance(inp, torch.Tensor) and inp.is_floating_point()
        last = s == num_stages - 1
        tgt = target.to(dev) if isinstance(target, torch.Tensor) else target

        def forward(feed, module=module, last=last, tgt=tgt):
            out = module(feed)
            return loss_fn(out, tgt) if last else out

        times = {"forward": [], "backward": [], "backward_input": []}
        out = None
        for _ in range(steps):
            feed = inp.detach().requires_grad_(True) if split else inp
            out, ms = timed(lambda feed=feed: forward(feed))
            times["forward"].append(ms)
            grad = None if last else torch.randn_like(out)
            _, ms = timed(lambda out=out, grad=grad: out.backward(grad))
            times["backward"].append(ms)
            module.zero_grad(set_to_none=True)
            if split:
                feed = inp.detach().requires_grad_(True)
                again = forward(feed)
                _, ms = timed(lambda again=again, feed=feed, grad=grad:
                              torch.autograd.grad(again, feed, grad))
                times["backward_input"].append(ms)
        measured["stages"][s] = {op: ms[1:] for op, ms in times.items()}
        x = out.detach() if not last else None
    if optimizer is not None:
        measured["optimizer"] = _optimizer_steps(optimizer, [get(s) for s in mine], steps, timed)
        measured["peak_memory_bytes"] = _peak_memory(dev)
    gathered = [None] * size
    dist.all_gather_object(gathered, measured, group=group)
    if rank != 0:
        return None
    stages = []
    for s in range(num_stages):
        times = next(g["stages"][s] for g in gathered if s in g["stages"])

        def op(name, ms, like=None):
            median, spread = _quartiles(ms)
            if like is not None:  # the weight gradient: the fused backward less the input's
                # (at least the clock's microsecond: where noise makes the input's backward the
                # longer, a timed pass of 0 ms is not a cost, and the costs reader refuses it)
                median = max(like[0] - median, 1e-3)
                spread = like[1]
            return {"op": name, "slice": 0, "median_ms": median, "spread_ms": spread,
                    "samples": len(ms)}

        ops = [op("forward", times["forward"])]
        if times["backward_input"]:
            ops.append(op("backward_input", times["backward_input"]))
            ops.append(op("backward_weight", times["backward_input"],
                          like=_quartiles(times["backward"])))
        else:
            ops.append(op("backward", times["backward"]))
        stages.append({"stage": s, "ops": ops})
    # One entry per message size (both directions cross the same boundary with one shape).
    by_bytes = {}
    for g in gathered:
        for m in g["messages"]:
            by_bytes.setdefault(m["bytes"], []).extend(m["ms"])
    messages = []
    for nbytes, ms in sorted(by_bytes.items()):
        median, spread = _quartiles(ms)
        for kind in ("activation", "gradient"):
            messages.append({"kind": kind, "bytes": nbytes, "median_ms": median,
                             "spread_ms": spread, "samples": len(ms)})
    ranks = []
    if optimizer is not None:
        for r, g in enumerate(gathered):
            median, spread = _quartiles(g["optimizer"])
            ranks.append({"rank": r, "optimizer": {"median_ms": median, "spread_ms": spread,
                                                   "samples": len(g["optimizer"])},
                          "peak_memory_bytes": g["peak_memory_bytes"]})
    params = [p for s in mine for p in get(s).parameters()]
    costs = {
        "format": "pipecost/1",
        "measured_on": {"backend": "torch", "dtype": str(params[0].dtype).replace("torch.", "")
                        if params else "unknown", "device": str(dev), "plan_hash": "",
                        "threads": size, "steps": steps},
        "slices": 1,
        "stages": stages,
        "messages": messages,
        "collectives": [],
        "ranks": ranks,
    }
    pipec._pipec.write_costs(json.dumps(costs), pipec._path("path", path), inputs)
    return costs


def _round_trips(x: torch.Tensor, first: bool, peer: int, steps: int, group, dev) -> list[float]:
    """Half of each of `steps` round trips of `x` between this rank and `peer` (global rank), in
    ms, the first dropped; `first` starts each trip. The tensor stays on the CPU for gloo."""
    on = dev if dist.get_backend(group) == "nccl" else torch.device("cpu")
    buf = x.detach().to(on).contiguous()
    if not buf.is_floating_point():
        buf = buf.float()
    ms = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if first:
            dist.send(buf, peer, group=group)
            dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group)
            dist.send(buf, peer, group=group)
        if on.type == "cuda":
            torch.cuda.synchronize(on)
        ms.append(1e3 * (time.perf_counter() - t0) / 2)
    return ms[1:]


def _optimizer_steps(make, modules, steps: int, timed) -> list[float]:
    """`steps` optimizer steps over the modules' parameters (gradients of ones where a backward
    left none), timed, the first dropped; the parameters and their gradients are put back."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    if not params:
        return [0.0] * (steps - 1)
    saved = [(p.detach().clone(), p.grad) for p in params]
    try:
        for p in params:
            p.grad = torch.ones_like(p)
        opt = make(params)
        ms = [timed(opt.step)[1] for _ in range(steps)]
    finally:
        with torch.no_grad():
            for p, (data, grad) in zip(params, saved):
                p.copy_(data)
                p.grad = grad
    return ms[1:]


def _peak_memory(dev) -> int:
    """The device's peak allocated bytes (CUDA), else this process's peak resident set."""
    if dev.type == "cuda":
        return int(torch.cuda.max_memory_allocated(dev))
    import resource  # noqa: PLC0415
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
