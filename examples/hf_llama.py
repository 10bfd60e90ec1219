"""Train a Hugging Face Llama under a pipec plan, from its config, in a few lines.

transformers builds the model; pipec makes its model spec from the config, compiles a zb-v plan
(a V-shape: the embedding and the head share rank 0, and their tied weights are kept equal),
and cuts the model into the plan's stages; PyTorch's pipelining runtime trains it on real
processes (gloo, CPU). The batch is fixed, so the loss falls as the model memorises it.

    .venv/bin/python examples/hf_llama.py [--pp 2] [--schedule zb-v] [--steps 20]

(after `bash tools/setup.sh` and `bazel build //python:pipec`).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

import pipec
import pipec.torch

CONFIG = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                  max_position_embeddings=32, tie_word_embeddings=True)
SEQ, BATCH = 32, 2  # tokens a sequence, sequences a microbatch


def train(rank: int, pp: int, schedule: str, steps: int, rendezvous: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=pp)
    torch.manual_seed(0)  # the same initial weights in every process
    model = transformers.AutoModelForCausalLM.from_config(CONFIG)
    spec = pipec.torch.model_spec(model.config, seq_length=SEQ, microbatch_size=BATCH)
    plan = pipec.compile(spec, schedule, pp=pp, microbatches=2 * pp,
                         **({"vpp": 2} if schedule in ("zb-v", "dualpipe-v") else {}))
    layers = pipec.torch.hf_layers(model)
    runner = pipec.torch.PipelineRunner(plan, pipec.torch.stage_modules(plan, layers),
                                        lambda logits, y: torch.nn.functional.cross_entropy(
                                            logits.flatten(0, 1), y.flatten()))
    optimizer = torch.optim.AdamW([p for layer in layers for p in layer.parameters()], lr=3e-3)
    tokens = torch.randint(0, CONFIG.vocab_size, (plan.microbatches * BATCH, SEQ + 1),
                           generator=torch.Generator().manual_seed(1))
    if rank == 0:
        print(f"{schedule} on {pp} ranks: {plan.stats.bubble_ratio:.1%} bubble predicted",
              flush=True)
    for step in range(steps):
        losses = []
        runner.step(tokens[:, :-1], target=tokens[:, 1:], losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        if losses:
            print(f"step {step} loss {sum(x.item() for x in losses) / len(losses):.4f}",
                  flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--schedule", default="zb-v")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(train, args=(a.pp, a.schedule, a.steps, os.path.join(tmp, "rendezvous")),
                 nprocs=a.pp)


if __name__ == "__main__":
    main()
