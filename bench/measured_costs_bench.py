"""Measured against predicted on the cpu backend: profile, compile with --costs, run.

For each schedule at pp = 2 (one rank thread per core): a plan of the model is run with
`piperun --profile` (the first step dropped as warm-up), recompiled with `pipec compile --costs`
from that profile, and run again; its last line (`step time: measured median X ms ...,
predicted Y ms (D%)`) gives the table. Not a test (tests/ProfileTest.cpp checks a loose bound);
the numbers go into docs/benchmarks.md:

    bazel build -c opt //tools:pipec //tools:piperun
    python3 bench/measured_costs_bench.py --bin bazel-bin/tools

The machine's other work slows the rank threads unevenly: on a shared machine the numbers are
noisy, and the profile and the run must see the same load for the prediction to hold. With
`--repeats R` (default 3) each schedule is profiled R times in separate processes, every
measured time of the profiles replaced by its median over the R (so one profiling run slowed
as a whole does not carry into the plan), and the fitted plan run R times: its measured step is
the median of the R runs' medians.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

SCHEDULES = [
    ("gpipe", []),
    ("1f1b", []),
    ("interleaved-1f1b", ["--vpp", "2"]),
    ("seq1f1b", ["--seq-splits", "2"]),
    ("zb-h1", []),
    ("zb-h2", []),
    ("zb-v", ["--vpp", "2"]),
    ("zb-auto", ["--memory-limit", "1GiB"]),
]

MODEL = {"format": "pipemodel/1", "name": "bench-gpt",
         "transformer": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
                         "ffn_hidden_size": 512, "vocab_size": 256, "seq_length": 64,
                         "microbatch_size": 2, "dtype": "fp32"}}

LINE = re.compile(r"step time: measured median ([0-9.]+) ms over (\d+) steps, "
                  r"predicted ([0-9.]+) ms \(([-+0-9.]+)%\)")


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return out.strip().splitlines()


def merge_profiles(profiles):
    """One pipecost/1 document whose every measured time is the median of the profiles' (they
    are of one plan, so their entries line up)."""
    keys = ("stage", "op", "slice", "kind", "bytes", "group", "rank")

    def merge(values):
        first = values[0]
        if isinstance(first, dict):
            for k in keys:
                if k in first and any(v.get(k) != first[k] for v in values):
                    sys.exit(f"the profiles of one plan differ in {k!r}")
            return {k: (statistics.median(v[k] for v in values) if k == "median_ms"
                        else merge([v[k] for v in values])) for k in first}
        if isinstance(first, list):
            if any(len(v) != len(first) for v in values):
                sys.exit("the profiles of one plan differ in shape")
            return [merge(list(items)) for items in zip(*values)]
        return first
    return merge(profiles)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", default="bazel-bin/tools", help="where pipec and piperun are")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedules", default=",".join(s for s, _ in SCHEDULES))
    parser.add_argument("--repeats", type=int, default=3,
                        help="profiles merged, and fitted runs, per schedule (medians)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats: expected 1 or more")
    pipec, piperun = (os.path.join(args.bin, t) for t in ("pipec", "piperun"))
    wanted = args.schedules.split(",")
    print(f"{'schedule':<18} {'measured ms':>12} {'predicted ms':>13} {'error':>8}")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "model.json")
        with open(model, "w") as f:
            json.dump(MODEL, f)
        for name, extra in SCHEDULES:
            if name not in wanted:
                continue
            base = [pipec, "compile", "--model", model, "--pp", "2", "--microbatches",
                    str(args.microbatches), "--schedule", name, "--quiet"] + extra
            plan, costs, fitted = (os.path.join(tmp, f"{name}.{x}.json")
                                   for x in ("plan", "costs", "fitted"))
            run(base + ["-o", plan])
            profiles = []
            for r in range(args.repeats):
                one = os.path.join(tmp, f"{name}.costs{r}.json")
                run([piperun, plan, "--backend", "cpu", "--steps", str(args.steps),
                     "--profile", one])
                with open(one) as f:
                    profiles.append(json.load(f))
            with open(costs, "w") as f:
                json.dump(merge_profiles(profiles), f)
            run(base + ["--costs", costs, "-o", fitted])
            steps, predicted = [], None
            for _ in range(args.repeats):
                last = run([piperun, fitted, "--backend", "cpu", "--steps", str(args.steps)])[-1]
                m = LINE.match(last)
                if not m:
                    sys.exit(f"{name}: unexpected last line: {last}")
                steps.append(float(m[1]))
                predicted = float(m[3])
            measured = statistics.median(steps)
            d = (measured / predicted - 1) * 100
            worst = max(worst, abs(d))
            print(f"{name:<18} {measured:>12.1f} {predicted:>13.1f} {d:>+7.1f}%", flush=True)
    print(f"largest error {worst:.1f}%")


if __name__ == "__main__":
    main()
