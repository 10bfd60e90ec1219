"""Train a small GPT-like model with PyTorch under a pipec plan.

pipec partitions the model and orders every rank's work (here zb-auto under a memory limit, a
schedule PyTorch itself does not have); PyTorch's pipelining runtime runs that order on real
processes (gloo, CPU). The task is learnable: every sequence counts up by one (mod the
vocabulary) from a random start, so the loss falls towards zero within a few dozen steps.

    .venv/bin/python examples/torch_gpt.py [--pp 2] [--schedule zb-auto] [--steps 30]

(after `bash tools/setup.sh` and `bazel build //python:pipec`). The layers here are what the
tests (python/tests/test_torch_train.py) check against a single-process run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

# The config of the model, in pipemodel/1's transformer terms (docs/pytorch.md).
CONFIG = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 128,
          "vocab_size": 64, "seq_length": 16, "microbatch_size": 2}


# What a CPU core with gloo roughly does (pipecluster/1), so that the plan's simulated times are
# this machine's rather than an H100's.
CPU_CLUSTER = {"format": "pipecluster/1",
               "device": {"name": "cpu", "peak_tflops": 0.05, "achieved_fraction": 0.5,
                          "memory_bytes": 8 * 2**30},
               "gpus_per_node": 64,
               "intra_node": {"bandwidth_GBps": 2, "latency_us": 50},
               "inter_node": {"bandwidth_GBps": 1, "latency_us": 100}}


def model_spec(cfg=CONFIG, name="torch-gpt") -> dict:
    """The pipemodel/1 spec pipec plans with: its layers are the embedding, the blocks and the
    head, one per nn.Module of build_layers()."""
    return {"format": "pipemodel/1", "name": name,
            "transformer": {**cfg, "dtype": "fp32", "tie_embeddings": False}}


class Embedding(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.wpe = nn.Embedding(cfg["seq_length"], cfg["hidden_size"])

    def forward(self, idx):  # (B, T) -> (B, T, C)
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, cfg):
        super().__init__()
        h, self.heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, cfg["ffn_hidden_size"])
        self.out = nn.Linear(cfg["ffn_hidden_size"], h)

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln = nn.LayerNorm(cfg["hidden_size"])
        self.lm = nn.Linear(cfg["hidden_size"], cfg["vocab_size"])

    def forward(self, x):  # (B, T, C) -> (B, T, V)
        return self.lm(self.ln(x))


def build_layers(cfg=CONFIG, seed=0) -> list[nn.Module]:
    """The model as pipec's layer list: embedding, num_layers blocks, head (seeded, so every
    process builds the same weights)."""
    torch.manual_seed(seed)
    return [Embedding(cfg)] + [Block(cfg) for _ in range(cfg["num_layers"])] + [Head(cfg)]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(cfg, microbatches, step):
    """Counting sequences: tokens[i] = start + i (mod vocab); the target is the next token."""
    g = torch.Generator().manual_seed(1000 + step)
    n, t, v = cfg["microbatch_size"] * microbatches, cfg["seq_length"], cfg["vocab_size"]
    start = torch.randint(0, v, (n, 1), generator=g)
    seq = (start + torch.arange(t + 1)) % v
    return seq[:, :-1], seq[:, 1:]


def compile_plan(args):
    import pipec  # noqa: PLC0415

    flags = {"cluster": CPU_CLUSTER}
    if args.vpp:
        flags["vpp"] = args.vpp
    if args.schedule == "zb-auto":
        flags["memory_limit"] = args.memory_limit
    return pipec.compile(model_spec(), args.schedule, pp=args.pp,
                         microbatches=args.microbatches, **flags)


def train(rank, world, init_file, plan_file, steps):
    """One pipeline rank: its stages of the model, trained with the plan's schedule."""
    import time  # noqa: PLC0415

    import pipec  # noqa: PLC0415 (each spawned process imports it itself)
    import pipec.torch  # noqa: PLC0415

    torch.set_num_threads(1)  # one core per rank: pp processes share the machine
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    plan = pipec.load(plan_file)
    layers = build_layers()
    pipe = pipec.torch.PipelineRunner(plan, pipec.torch.stage_modules(plan, layers), loss_fn)
    params = [p for st in pipe.stages for p in st.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    start = time.perf_counter()
    for step in range(steps):
        tokens, targets = batch(CONFIG, plan.microbatches, step)
        opt.zero_grad()
        losses = []
        pipe.step(tokens, target=targets, losses=losses)
        opt.step()
        if pipe.has_last_stage and (step % max(1, steps // 6) == 0 or step == steps - 1):
            loss = torch.stack(losses).mean().item()
            print(f"step {step:3d}  loss {loss:.4f}  (rank {rank}, {len(losses)} microbatches, "
                  f"{time.perf_counter() - start:.1f} s)", flush=True)
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=0, help="for interleaved-1f1b, zb-v, ...")
    parser.add_argument("--schedule", default="zb-auto")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--memory-limit", default="400KiB",
                        help="zb-auto's bound on each rank's activations")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    plan = compile_plan(args)
    print(plan)
    print("stages (layers, rank): " + " ".join(
        f"{s['stage']}:[{s['layers'][0]},{s['layers'][1]})@r{s['rank']}" for s in plan.stages))
    print("rank 0: " + plan.export_torch_csv().splitlines()[0], flush=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        plan_file = os.path.join(tmp, "plan.json")
        plan.save(plan_file)
        mp.spawn(train, args=(args.pp, os.path.join(tmp, "rendezvous"), plan_file, args.steps),
                 nprocs=args.pp)


if __name__ == "__main__":
    sys.exit(main())
