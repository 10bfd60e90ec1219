"""Compile + verify + simulate from Python, to set against bench/compile_bench.cpp (C++).

The same plan as compile_bench: one unit layer per stage (F = B = W = 1, 1 MiB of activations,
64 KiB outputs, 4 MiB of parameters, p2p 0.1), through pipec.compile (the model passed as a
dict, so its JSON is written and parsed too). Best of --repeat. Not a test; the numbers go into
docs/benchmarks.md:

    bazel build -c opt //python:pipec
    .venv/bin/python bench/python_compile_bench.py --pp 8 --microbatches 24
    bazel run -c opt //bench:compile_bench -- --pp 8 --microbatches 24 --repeat 200
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "python"))
import pipec  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=24)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    model = {"format": "pipemodel/1", "name": "uniform", "p2p_time": 0.1,
             "layers": [{"name": "l", "count": args.pp, "forward": 1.0, "backward_input": 1.0,
                         "backward_weight": 1.0, "activation_bytes": 1 << 20,
                         "output_bytes": 1 << 16, "param_bytes": 1 << 22}]}
    best = float("inf")
    for _ in range(args.repeat):
        start = time.perf_counter()
        plan = pipec.compile(model, args.schedule, pp=args.pp, microbatches=args.microbatches)
        best = min(best, time.perf_counter() - start)
    print(f"schedule={args.schedule} pp={args.pp} microbatches={args.microbatches} "
          f"instructions={plan.num_instructions} best_of_{args.repeat}={best * 1e3:.3f}ms "
          f"bubble={plan.stats.bubble_ratio:.4f}")


if __name__ == "__main__":
    main()
