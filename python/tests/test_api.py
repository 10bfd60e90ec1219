"""The pipec package against the pipec command and against closed forms."""

import json
import os
import pathlib
import random

import pytest

import pipec
from conftest import example, run_pipec


def test_1f1b_bubble_is_the_closed_form(uniform8):
    plan = pipec.compile(uniform8, "1f1b", pp=4, microbatches=8)
    assert plan.stats.bubble_ratio == pytest.approx(3 / 11)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubbles_are_p_minus_1_over_m_plus_p_minus_1(schedule):
    model = {"format": "pipemodel/1", "name": "u12",
             "layers": [{"name": "l", "count": 12, "forward": 1.0, "backward_input": 1.0,
                         "backward_weight": 1.0, "activation_bytes": 1, "param_bytes": 1,
                         "output_bytes": 1}]}
    for p in (2, 3, 4, 6):
        for m in (1, 2, 5, 12):
            plan = pipec.compile(model, schedule, pp=p, microbatches=m)
            assert plan.stats.bubble_ratio == pytest.approx((p - 1) / (m + p - 1)), (p, m)
            assert plan.stats.makespan == pytest.approx((m + p - 1) * 3 * 12 / p), (p, m)


@pytest.mark.parametrize("args", [
    ("uniform-8.json", "1f1b", 4, 8, {}),
    ("uniform-8.json", "zb-v", 2, 6, {"vpp": 2}),
    ("uniform-8.json", "seq1f1b", 2, 4, {"seq_splits": 2}),
    ("uniform-8.json", "zb-auto", 4, 8, {"memory_limit": "16MiB"}),
    ("tiny-gpt.json", "interleaved-1f1b", 2, 4, {"vpp": 2, "tp": 2, "dp": 2}),
    ("tiny-gpt.json", "dualpipe-v", 2, 4, {"vpp": 2, "cluster": "h100-2nodes.json"}),
    ("tiny-llama.json", "zb-h1", 2, 4, {"tp": 2}),
    ("llama3-8b.json", "interleaved-1f1b", 4, 8, {"vpp": 2, "tp": 8}),
])
def test_compile_gives_the_commands_plan_byte_for_byte(args, tmp_path):
    model, schedule, pp, m, flags = args
    out = tmp_path / "plan.json"
    cli = ["compile", "--model", example(model), "--schedule", schedule, "--pp", str(pp),
           "--microbatches", str(m), "-o", str(out), "--quiet"]
    for key, value in flags.items():
        if key == "cluster":
            value = example(value)
            flags = {**flags, "cluster": value}
        cli += ["--" + key.replace("_", "-"), str(value)]
    r = run_pipec(*cli)
    assert r.returncode == 0, r.stderr
    plan = pipec.compile(example(model), schedule, pp=pp, microbatches=m, **flags)
    assert plan.json == out.read_text()


def test_throughput_is_the_commands_line_and_the_closed_form(uniform8, tmp_path):
    # GPT-3 175B at tp 4, pp 8 (6 virtual stages), dp 16 on the H100 spec: the numbers of
    # `pipec compile`'s throughput: line, and tokens/s and model FLOP/s from the step time by the
    # closed form of contracts.md (matrices 3·b·s·(8h² + 4hf) per block, causal attention
    # 12·h·b·Σ(t+1), the head 3·2·b·s·h·v).
    flags = {"vpp": 6, "tp": 4, "dp": 16, "cluster": example("h100-nemo.json"),
             "sequence_parallel": True, "distributed_optimizer": True}
    plan = pipec.compile(example("gpt3-175b.json"), "interleaved-1f1b", pp=8, microbatches=128,
                         **flags)
    th = plan.throughput
    seconds, gpus = plan.stats.step_time / 1000, 4 * 8 * 16
    l, h, f, v, s, b, m, dp = 96, 12288, 49152, 51200, 2048, 1, 128, 16
    assert th["tokens_per_second"] == pytest.approx(m * dp * b * s / seconds)
    assert th["tokens_per_second_per_gpu"] == pytest.approx(m * dp * b * s / seconds / gpus)
    per_microbatch = (l * (3 * b * s * (8 * h * h + 4 * h * f) + 12 * h * b * s * (s + 1) / 2)
                      + 3 * 2 * b * s * h * v)
    tflops = per_microbatch * m * dp / seconds / gpus / 1e12
    assert th["tflops_per_gpu"] == pytest.approx(tflops)
    assert th["mfu"] == pytest.approx(tflops / 989)
    r = run_pipec("compile", "--model", example("gpt3-175b.json"), "--schedule",
                  "interleaved-1f1b", "--pp", "8", "--microbatches", "128", "--vpp", "6", "--tp",
                  "4", "--dp", "16", "--cluster", example("h100-nemo.json"),
                  "--sequence-parallel", "--distributed-optimizer")
    assert r.returncode == 0, r.stderr
    assert (f"throughput: {th['tokens_per_second']:.0f} tokens/s "
            f"({th['tokens_per_second_per_gpu']:.0f} per GPU), {th['tflops_per_gpu']:.1f} TFLOP/s "
            f"per GPU of model FLOPs, MFU {100 * th['mfu']:.1f}%") in r.stdout
    # --microbatch-size (microbatch_size=) overrides the spec's 1: twice the tokens a step.
    two = pipec.compile(example("gpt3-175b.json"), "interleaved-1f1b", pp=8, microbatches=128,
                        microbatch_size=2, **flags)
    assert two.throughput["tokens_per_second"] * two.stats.step_time / 1000 == pytest.approx(
        m * dp * 2 * s)
    # Re-simulated, the same; an abstract model's plan and one read from JSON have none.
    assert pipec.simulate(plan).throughput == th
    saved = tmp_path / "plan.json"
    plan.save(str(saved))
    assert pipec.load(str(saved)).throughput is None
    assert pipec.compile(uniform8, "1f1b", pp=4, microbatches=8).throughput is None
    best = pipec.plan(example("gpt3-175b.json"), 512, 2048, cluster=example("h100-nemo.json"),
                      tp=[4], pp=[8], schedules=["1f1b"], microbatch_sizes=[1], top=1, threads=1)
    row = best.ranked[0]
    assert best.best.throughput["tokens_per_second"] == pytest.approx(
        2048 * 2048 / (row["step_time"] / 1000))
    assert row["throughput"] == best.best.throughput
    assert pipec.plan(uniform8, 8, 16, top=1).ranked[0]["throughput"] is None


def test_a_llama_model_carries_its_block_into_the_plan():
    plan = pipec.compile(example("llama3-8b.json"), "1f1b", pp=4, microbatches=8, tp=8)
    block = plan.to_dict()["transformer"]
    assert (block["norm"], block["mlp"], block["position"]) == ("rmsnorm", "swiglu", "rope")
    assert block["num_query_groups"] == 8 and block["bias"] is False
    with pytest.raises(ValueError, match=r"--tp 16 must divide num_query_groups \(8\)"):
        pipec.compile(example("llama3-8b.json"), "1f1b", pp=4, microbatches=8, tp=16)


def test_a_model_dict_and_its_file_give_the_same_plan(uniform8):
    with open(uniform8) as f:
        spec = json.load(f)
    a = pipec.compile(spec, "zb-h1", pp=4, microbatches=8)
    b = pipec.compile(uniform8, "zb-h1", pp=4, microbatches=8)
    assert a.json == b.json


def test_plan_exposes_streams_text_grid_stages_and_stats(uniform8, tmp_path):
    plan = pipec.compile(uniform8, "1f1b", pp=2, microbatches=3)
    assert plan.schedule == "1f1b" and plan.pp == 2 and plan.microbatches == 3
    assert plan.placement == "loop" and plan.time_unit == "unit"
    assert [s["layers"] for s in plan.stages] == [(0, 4), (4, 8)]
    compute = [i for i in plan.instructions(1) if i["op"] in ("forward", "backward")]
    assert [(i["op"][0], i["mb"]) for i in compute] == [("f", 0), ("b", 0), ("f", 1), ("b", 1),
                                                        ("f", 2), ("b", 2)]
    assert plan.text.splitlines()[1].startswith("rank 1: 1RECV_F0#0 1RECV_F1#0 1F0 1B0 1SEND_B0")
    assert "rank 0" in plan.grid() and "step" in plan.grid(compute_only=True)
    assert plan.num_instructions == sum(len(r) for r in plan.ranks)
    shown = run_pipec("show", str(_saved(plan, tmp_path)), "--text")
    assert shown.stdout.split("\n", 1)[1] == plan.text
    assert len(plan.stats.ranks) == 2 and plan.stats.ranks[1].peak_activation_bytes > 0
    with pytest.raises(ValueError, match=r"rank: expected a rank in 0..1"):
        plan.instructions(2)


def _saved(plan, tmp_path):
    path = tmp_path / "saved.json"
    plan.save(path)
    return path


def test_load_validate_and_simulate_agree_with_the_command(uniform8, tmp_path):
    plan = pipec.compile(uniform8, "zb-h2", pp=4, microbatches=8)
    path = _saved(plan, tmp_path)
    assert pipec.load(path).json == plan.json
    assert pipec.validate(path) is None
    trace = tmp_path / "trace.json"
    again = pipec.simulate(path, trace=trace)
    assert again.stats == plan.stats
    assert json.loads(trace.read_text())["traceEvents"]
    cli = run_pipec("simulate", str(path))
    assert f"bubble ratio {plan.stats.bubble_ratio:.4f}" in cli.stdout


def test_validate_raises_plan_error_with_the_verifiers_diagnostic(uniform8, tmp_path):
    plan = pipec.compile(uniform8, "1f1b", pp=2, microbatches=2).to_dict()
    stream = plan["ranks"][1]["instructions"]
    first = next(i for i, x in enumerate(stream) if x["op"] == "forward")
    second = next(i for i, x in enumerate(stream) if x["op"] == "backward")
    stream[first], stream[second] = stream[second], stream[first]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(plan))
    with pytest.raises(pipec.PlanError) as err:
        pipec.validate(path)
    cli = run_pipec("validate", str(path))
    assert cli.returncode == 1
    assert str(err.value).rstrip("\n") == cli.stderr.removeprefix("pipec: ").rstrip("\n")
    assert "<-- here" in str(err.value)


def test_bad_input_raises_value_error_with_the_commands_line(uniform8):
    cli = run_pipec("compile", "--model", uniform8, "--schedule", "interleaved-1f1b", "--pp",
                    "4", "--vpp", "2", "--microbatches", "6")
    assert cli.returncode == 2
    with pytest.raises(ValueError) as err:
        pipec.compile(uniform8, "interleaved-1f1b", pp=4, vpp=2, microbatches=6)
    assert str(err.value) == cli.stderr.removeprefix("pipec: error: ").rstrip("\n")


@pytest.mark.parametrize("call, message", [
    (lambda m: pipec.compile(m, "1f1c", pp=4, microbatches=8), "unknown schedule '1f1c'"),
    (lambda m: pipec.compile(m, "1f1b", pp=0, microbatches=8), "--pp must be at least 1"),
    (lambda m: pipec.compile(m, "1f1b", pp=16, microbatches=8), "try --pp 8"),
    (lambda m: pipec.compile(m, "1f1b", pp=2, microbatches="x"), "--microbatches expects"),
    (lambda m: pipec.compile(m, "1f1b", pp=True, microbatches=8), "--pp expects an integer"),
    (lambda m: pipec.compile(m, "1f1b", pp=2, microbatches=8, vp=2), "unknown argument 'vp'"),
    (lambda m: pipec.compile(m, 7, pp=2, microbatches=8), "schedule: --schedule expects a str"),
    (lambda m: pipec.compile(42, "1f1b", pp=2, microbatches=8), "model: expected a dict"),
    (lambda m: pipec.compile({"format": "pipemodel/1"}, "1f1b", pp=2, microbatches=8),
     "model: $: expected exactly one of"),
    (lambda m: pipec.compile({"x": {1, 2}}, "1f1b", pp=2, microbatches=8), "model: not JSON"),
    (lambda m: pipec.compile("/no/such.json", "1f1b", pp=2, microbatches=8), "cannot read"),
    (lambda m: pipec.compile(m, "zb-auto", pp=2, microbatches=8), "needs --memory-limit"),
    (lambda m: pipec.compile(m, "1f1b", pp=2, microbatches=8, memory_limit="lots"),
     "--memory-limit expects a positive byte count"),
    (lambda m: pipec.compile(m, "1f1b", pp=2, microbatches=8, cluster=[1]),
     "cluster: expected a dict"),
    (lambda m: pipec.validate(3), "plan: expected a pipec.Plan"),
    (lambda m: pipec.load("/no/plan.json"), "cannot read"),
    (lambda m: pipec.import_torch_csv("/no/sched.csv", m), "cannot read"),
    (lambda m: pipec.import_torch_csv("0F0,0Q0\n", m), "row 1 (rank 0), column 2: '0Q0'"),
])
def test_bad_input_raises_value_error_naming_the_flag(uniform8, call, message):
    with pytest.raises(ValueError) as err:
        call(uniform8)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_plan_over_the_memory_limit_is_a_plan_error(uniform8):
    with pytest.raises(pipec.PlanError, match="over --memory-limit"):
        pipec.compile(uniform8, "gpipe", pp=2, microbatches=8, memory_limit="4MiB")


def test_list_schedules_is_the_commands_list():
    names = [s["name"] for s in pipec.list_schedules()]
    cli = run_pipec("list-schedules").stdout.splitlines()
    assert names == [line.split()[0] for line in cli if not line.startswith(" ")]
    assert {s["placement"] for s in pipec.list_schedules()} == {"loop", "v-shape"}


def test_export_and_import_match_the_commands(uniform8, tmp_path):
    plan = pipec.compile(uniform8, "dualpipe-v", pp=2, vpp=2, microbatches=4)
    path = _saved(plan, tmp_path)
    for comms, form in ((False, "torch-csv"), (True, "torch-csv-comms")):
        csv = tmp_path / f"{form}.csv"
        cli = run_pipec("export", str(path), "--format", form, "-o", str(csv))
        assert cli.returncode == 0, cli.stderr
        assert pipec.export_torch_csv(plan, comms=comms).encode() == csv.read_bytes()
        pipec.export_torch_csv(path, comms=comms, path=csv)
        back = pipec.import_torch_csv(csv, uniform8)
        assert back.json == plan.json
        assert "the order is pipec's dualpipe-v" in back.import_report
        out = tmp_path / "back.json"
        r = run_pipec("import", str(csv), "--model", uniform8, "-o", str(out))
        assert r.returncode == 0, r.stderr
        assert out.read_text() == plan.json


def test_import_reads_text_file_objects_and_pipec_text(uniform8, tmp_path):
    plan = pipec.compile(uniform8, "zb-h1", pp=4, microbatches=8)
    csv = plan.export_torch_csv()
    assert pipec.import_torch_csv(csv, uniform8).json == plan.json
    path = tmp_path / "s.csv"
    path.write_text(csv)
    with open(path) as f:
        assert pipec.import_torch_csv(f, uniform8).json == plan.json
    assert pipec.import_torch_csv(plan.text, uniform8).json == plan.json


def test_import_of_a_wrong_schedule_raises_plan_error_naming_rank_and_step(uniform8):
    with pytest.raises(pipec.PlanError) as err:
        pipec.import_torch_csv("0F0,0F1,0B0,0B1\n1F0,1B1,1F1,1B0\n", uniform8)
    assert "rank 1 step 1 (1B1)" in str(err.value)


def test_import_names_a_schedule_pipec_does_not_have_custom(uniform8):
    # GPipe on rank 0, neither GPipe nor 1F1B on rank 1: valid, but no pipec policy.
    plan = pipec.import_torch_csv("0F0,0F1,0F2,0B0,0B1,0B2\n1F0,1B0,1F1,1F2,1B1,1B2\n",
                                  uniform8)
    assert plan.schedule == "custom"
    assert plan.pp == 2 and plan.microbatches == 3 and plan.placement == "loop"
    assert "none of pipec's schedules" in plan.import_report
    pipec.validate(plan)


def test_export_refuses_what_pytorch_cannot_express():
    tied = {"format": "pipemodel/1", "name": "t", "transformer": {
        "num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "ffn_hidden_size": 32,
        "vocab_size": 32, "seq_length": 8, "microbatch_size": 1, "dtype": "fp32",
        "tie_embeddings": True}}
    plan = pipec.compile(tied, "1f1b", pp=2, microbatches=2)
    with pytest.raises(ValueError, match='"tie_embeddings": false'):
        plan.export_torch_csv()
    plan = pipec.compile(example("uniform-8.json"), "seq1f1b", pp=2, microbatches=2, seq_splits=2)
    with pytest.raises(ValueError, match="--seq-splits 1"):
        pipec.export_torch_csv(plan, comms=True)


def _garbage(rng):
    pool = [0, -1, 1, 2, 3, 2**31, 2**63 - 1, -2**63, 10**30, 1.5, float("nan"), float("inf"),
            "", "4", "-3", "1e9", "80GiB", "\x00", "é", "uniform-8.json", None, True, [], [1],
            {}, {"format": "pipemodel/1"}, {"layers": [{"count": 10**12}]}, b"bytes", object(),
            {"format": "pipemodel/1", "name": "x",
             "layers": [{"name": "l", "count": rng.randint(-2, 70000), "forward": 1.0,
                         "backward_input": 1.0, "backward_weight": 1.0}]},
            "0F0,0B0\n", "rank 0: 0F0 0B0\n", "(0F0;0B0)OVERLAP_F_B\n", "0F999999999,0B0\n",
            "\"unterminated\n", ",,,\n,,\n", "rank 9999: 0F0\n"]
    return rng.choice(pool)


def test_whatever_python_passes_in_raises_only_value_error_or_plan_error(uniform8):
    rng = random.Random(1234)
    schedules = [s["name"] for s in pipec.list_schedules()] + ["nope"]
    calls = 0
    for _ in range(400):
        kind = rng.randrange(4)
        try:
            if kind == 0:
                flags = {k: _garbage(rng) for k in rng.sample(
                    ["vpp", "seq_splits", "tp", "dp", "memory_limit", "microbatch_group_size",
                     "cluster"], rng.randrange(3))}
                pipec.compile(rng.choice([uniform8, _garbage(rng)]), rng.choice(schedules),
                              pp=rng.choice([1, 2, 4, _garbage(rng)]),
                              microbatches=rng.choice([1, 3, 8, _garbage(rng)]), **flags)
            elif kind == 1:
                pipec.import_torch_csv(_garbage(rng), rng.choice([uniform8, _garbage(rng)]),
                                       vpp=rng.choice([None, 1, 2, _garbage(rng)]))
            elif kind == 2:
                pipec.validate(_garbage(rng))
            else:
                pipec.simulate(_garbage(rng))
            calls += 1
        except (ValueError, pipec.PlanError):
            calls += 1
    assert calls == 400


@pytest.mark.parametrize("call, message", [
    (lambda m: pipec.compile(m, "1f1b", pp="2", microbatches=8),
     "pp: --pp expects an integer (got str '2')"),
    (lambda m: pipec.compile(m, "1f1b", pp=2.0, microbatches=8),
     "pp: --pp expects an integer (got float 2.0)"),
    (lambda m: pipec.compile(m, "1f1b", pp=True, microbatches=8),
     "pp: --pp expects an integer (got bool True)"),
    (lambda m: pipec.compile(m, "1f1b", pp=2, microbatches=8, sequence_parallel=1),
     "sequence_parallel: --sequence-parallel expects True or False (got int 1)"),
    (lambda m: pipec.compile(m, "1f1b", pp=2, microbatches=8, recompute=2),
     "recompute: --recompute expects one of none, selective, full (got int 2)"),
    (lambda m: pipec.compile(m, "1f1b", pp=2, microbatches=8, memory_limit=1.5),
     "memory_limit: --memory-limit expects a byte count"),
    (lambda m: pipec.compile(m, "1f1b", pp=2, microbatches=8, cluster=3),
     "cluster: expected a dict or a path"),
    (lambda m: pipec.compile(m, "1f1b", pp=2, microbatches=8, show=True),
     "compile: unknown argument 'show'"),
    (lambda m: pipec.compile(m, "1f1b", pp=2, microbatches=8, model_json="{}"),
     "compile: unknown argument 'model_json'"),
    (lambda m: pipec.plan(m, 8, 64, tp=2), "tp: --tp expects a list of ints (got int 2)"),
    (lambda m: pipec.plan(m, 8, 64, schedules="1f1b"), "schedules: --schedules expects a list"),
    (lambda m: pipec.import_torch_csv("0F0,0B0\n", m, vpp="1"), "vpp: --vpp expects an integer"),
])
def test_a_wrong_type_is_a_type_error_naming_the_argument(uniform8, call, message):
    with pytest.raises(TypeError) as err:
        call(uniform8)
    assert message in str(err.value)
    assert isinstance(err.value, ValueError)  # what such mistakes raised before


def test_a_context_parallel_plan_says_its_cp():
    plan = pipec.compile(example("tiny-gpt.json"), "1f1b", pp=2, microbatches=4, cp=2)
    assert plan.cp == 2 and plan.parallel["cp"] == 2
    assert " cp=2 " in repr(plan)
    plain = pipec.compile(example("tiny-gpt.json"), "1f1b", pp=2, microbatches=4)
    assert plain.cp == 1 and "cp=" not in repr(plain)


def test_the_keyword_arguments_are_the_commands_table():
    # Every flag `pipec compile --help` lists is an argument, but its outputs and printing.
    cli = run_pipec("compile", "--help").stdout
    flags = {line.split()[0].rstrip(",") for line in cli.split("flags:\n")[1].splitlines()
             if line.startswith("  -")}
    python = {o["name"] for o in pipec.options("compile")}
    assert python == flags - {"-o", "--show", "--trace", "--svg", "--quiet"}
    kinds = {o["python"]: o["kind"] for o in pipec.options("compile")}
    assert kinds["pp"] == "int" and kinds["sequence_parallel"] == "switch"
    assert kinds["memory_limit"] == "bytes" and kinds["recompute"] == "enum"
    assert kinds["model"] == "path" and kinds["costs"] == "path"
    assert {o["python"] for o in pipec.options("plan")} >= {"gpus", "global_batch", "tp", "pp"}


def test_compile_takes_every_flag_of_the_command_with_its_type(tmp_path):
    gpt = example("tiny-gpt.json")
    cases = [
        ({"recompute": "full"}, ["--recompute", "full"]),
        ({"recompute": "selective", "tp": 2, "sequence_parallel": True},
         ["--recompute", "selective", "--tp", "2", "--sequence-parallel"]),
        ({"dp": 2, "distributed_optimizer": True}, ["--dp", "2", "--distributed-optimizer"]),
        ({"cp": 2, "tp": 2}, ["--cp", "2", "--tp", "2"]),
        ({"seq_splits": 2, "seq_split_by": "flops"}, ["--seq-splits", "2", "--seq-split-by",
                                                      "flops"]),
        ({"memory_limit": 1 << 30, "sequence_parallel": False}, ["--memory-limit", "1GiB"]),
    ]
    for flags, cli in cases:
        schedule = "seq1f1b" if "seq_splits" in flags else "1f1b"
        out = tmp_path / "plan.json"
        r = run_pipec("compile", "--model", gpt, "--schedule", schedule, "--pp", "2",
                      "--microbatches", "4", "-o", str(out), "--quiet", *cli)
        assert r.returncode == 0, r.stderr
        plan = pipec.compile(gpt, schedule, pp=2, microbatches=4, **flags)
        assert plan.json == out.read_text(), flags
    full = pipec.compile(gpt, "1f1b", pp=2, microbatches=4, recompute="full")
    none = pipec.compile(gpt, "1f1b", pp=2, microbatches=4, recompute="none")
    assert full.to_dict()["transformer"]["recompute"] == "full"
    # Full recomputation keeps only each layer's input: less activation memory than none.
    assert (max(r.peak_activation_bytes for r in full.stats.ranks)
            < max(r.peak_activation_bytes for r in none.stats.ranks))
    with pytest.raises(ValueError, match="--recompute: the model is an abstract layer list"):
        pipec.compile(example("uniform-8.json"), "1f1b", pp=2, microbatches=4, recompute="full")
    with pytest.raises(ValueError, match=r"--recompute: expected none, selective or full"):
        pipec.compile(gpt, "1f1b", pp=2, microbatches=4, recompute="most")


def _plan_rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  schedule"))
    rows = []
    for line in lines[header + 1:]:
        # The table ends at the first line that is not a ranked row (a blank line, or the
        # calibration line right under it).
        if not line.split() or not line.split()[0].isdigit():
            break
        rows.append(line.split())
    return rows


def test_plan_ranks_the_layouts_the_command_ranks(tmp_path):
    gpt = example("tiny-gpt.json")
    best = tmp_path / "best.json"
    r = run_pipec("plan", "--model", gpt, "--gpus", "4", "--global-batch", "8", "--top", "4",
                  "--pp", "1,2", "--threads", "1", "-o", str(best))
    assert r.returncode == 0, r.stderr
    found = pipec.plan(gpt, 4, 8, top=4, pp=[1, 2], threads=1)
    assert found.best.json == best.read_text()
    rows = _plan_rows(r.stdout)
    assert len(rows) == len(found.ranked) == 4
    for row, layout in zip(rows, found.ranked):
        on = {True: "on", False: "off"}
        assert row[1:12] == [layout["schedule"], *map(str, (
            layout["tp"], layout["pp"], layout["vpp"], layout["dp"], layout["microbatch_size"],
            layout["microbatches"], layout["seq_splits"])), layout["recompute"],
            on[layout["sequence_parallel"]], on[layout["distributed_optimizer"]]]
        assert float(row[12]) == pytest.approx(layout["step_time"], abs=5e-4)
        assert layout["costs"] == "model"
        # Every ranked layout uses the GPUs asked for and trains the global batch.
        assert layout["tp"] * layout["pp"] * layout["dp"] == 4
        assert layout["dp"] * layout["microbatch_size"] * layout["microbatches"] == 8
    steps = [layout["step_time"] for layout in found.ranked]
    assert steps == sorted(steps)
    assert found.searched > len(found.ranked) and set(found.dropped) == {
        "divisibility", "constraint", "memory", "pruned"}
    assert all(layout["pp"] in (1, 2) for layout in found.ranked)
    assert all(layout["cp"] == 1 for layout in found.ranked)
    # Context parallelism where listed: the table gains a cp column, the same as the dicts'.
    r = run_pipec("plan", "--model", gpt, "--gpus", "4", "--global-batch", "8", "--top", "3",
                  "--cp", "2", "--threads", "1")
    assert r.returncode == 0, r.stderr
    found = pipec.plan(gpt, 4, 8, top=3, cp=[2], threads=1)
    for row, layout in zip(_plan_rows(r.stdout), found.ranked):
        assert row[1:6] == [layout["schedule"], *map(str, (
            layout["tp"], layout["cp"], layout["pp"], layout["vpp"]))]
        assert layout["cp"] == 2
        assert layout["tp"] * layout["cp"] * layout["pp"] * layout["dp"] == 4


def test_plan_gives_each_layout_its_schedules_calibration_record():
    # The shipped A100 spec's record (examples/a100-selene.json) against each ranked schedule,
    # as `pipec plan` prints it; an uncalibrated spec has none.
    gpt = example("gpt-7b-8k.json")
    spec = json.loads(pathlib.Path(example("a100-selene.json")).read_text())
    record = spec["calibration"]["held_out_error"]
    found = pipec.plan(gpt, 8, 16, top=6, pp=[2, 4], threads=1,
                       cluster=example("a100-selene.json"))
    assert found.ranked
    for layout in found.ranked:
        assert layout["held_out_error"] == record.get(layout["schedule"]), layout
    bare = pipec.plan(gpt, 8, 16, top=3, pp=[2, 4], threads=1, cluster=example("a100-80g.json"))
    assert all(layout["held_out_error"] is None for layout in bare.ranked)


def test_plan_scores_the_layouts_a_costs_file_covers_with_it(tmp_path):
    # A profile of 2 stages, 1 slice: it scores pp 2 layouts; pp 1 ones keep the cost model's.
    gpt = example("tiny-gpt.json")
    ops = [{"op": op, "slice": 0, "median_ms": ms + s, "spread_ms": 0.1, "samples": 8}
           for op, ms in (("forward", 3.0), ("backward_input", 4.0), ("backward_weight", 2.0))
           for s in range(1)]
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({
        "format": "pipecost/1",
        "measured_on": {"backend": "cpu", "dtype": "fp32", "device": "test", "plan_hash": "0",
                        "threads": 1, "steps": 5},
        "slices": 1, "stages": [{"stage": s, "ops": ops} for s in range(2)],
        "messages": [], "collectives": [], "ranks": []}))
    found = pipec.plan(gpt, 2, 8, tp=[1], microbatch_sizes=[2], pp=[1, 2], schedules=["1f1b"],
                       costs=str(costs), top=2, threads=1)
    by_pp = {layout["pp"]: layout for layout in found.ranked}
    assert by_pp[2]["costs"] == "measured" and by_pp[1]["costs"] == "model"
    compiled = pipec.compile(gpt, "1f1b", pp=2, microbatches=4, costs=str(costs))
    assert by_pp[2]["step_time"] == compiled.stats.step_time
    # 4 microbatches of 9 ms of compute on each rank bound the step from below.
    assert by_pp[2]["step_time"] >= 36
    with pytest.raises(ValueError, match="--costs: a costs file does not record the tp"):
        pipec.plan(gpt, 2, 8, microbatch_sizes=[2], costs=str(costs))


def test_plan_raises_the_commands_errors(uniform8):
    gpt = example("tiny-gpt.json")
    cli = run_pipec("plan", "--model", gpt, "--gpus", "4", "--global-batch", "8", "--top", "0")
    with pytest.raises(ValueError) as err:
        pipec.plan(gpt, 4, 8, top=0)
    assert str(err.value) == cli.stderr.removeprefix("pipec: error: ").rstrip("\n")
    with pytest.raises(pipec.PlanError):
        pipec.plan(gpt, 4, 8, memory_limit=1024)
