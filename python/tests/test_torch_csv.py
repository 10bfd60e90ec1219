"""pipec's PyTorch CSV judged by the pinned PyTorch's own code: its loader (_load_csv in both
formats), validator (_validate_schedule), lowering (_add_send_recv, _add_wait_send, ...),
comms simulator (_simulate_comms_compute), and its own schedule classes' orders."""

import types
import warnings

import pytest

import pipec

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
torch = pytest.importorskip("torch")
from torch.distributed.pipelining import schedules as S  # noqa: E402

UNIFORM = {"format": "pipemodel/1", "name": "u24",
           "layers": [{"name": "l", "count": 24, "forward": 1.0, "backward_input": 2.0,
                       "backward_weight": 1.0, "activation_bytes": 1 << 20,
                       "weight_grad_bytes": 1 << 18, "param_bytes": 1 << 22,
                       "output_bytes": 1 << 16}],
           "p2p_time": 0.1}


def test_pytorch_is_the_pinned_version():
    import pipec.torch  # noqa: PLC0415
    assert torch.__version__.split("+")[0] == pipec.torch.PINNED_TORCH


def _configs():
    out = []
    for name, vpps in [("gpipe", [1]), ("1f1b", [1]), ("interleaved-1f1b", [2, 3]),
                       ("zb-h1", [1]), ("zb-h2", [1]), ("zb-v", [2]), ("zb-auto", [1]),
                       ("dualpipe-v", [2])]:
        for p in (2, 3, 4, 5):
            for m in sorted({1, p - 1, p, p + 1, 2 * p, 3 * p + 1} - {0}):
                for v in vpps:
                    flags = {"vpp": v}
                    if name == "zb-auto":
                        flags["memory_limit"] = p * 2 * (4 << 20)
                    try:
                        pipec.compile(UNIFORM, name, pp=p, microbatches=m, **flags)
                    except ValueError:
                        continue  # a configuration the policy does not take
                    out.append((name, p, m, flags))
    return out


CONFIGS = _configs()


def _runtime(pp, num_stages, microbatches):
    """PyTorch's real _PipelineScheduleRuntime; the stages are stand-ins that carry only what
    its constructor reads (no process group is needed to load and lower a schedule)."""
    stage = types.SimpleNamespace(num_stages=num_stages, group_size=pp, group_rank=0,
                                  stage_index=0)
    return S._PipelineScheduleRuntime([stage], n_microbatches=microbatches,
                                      loss_fn=lambda out, target: out)


def _load(csv, tmp_path, plan, fmt):
    path = tmp_path / "sched.csv"
    path.write_text(csv, newline="")
    runtime = _runtime(plan.pp, plan.num_stages, plan.microbatches)
    runtime._load_csv(str(path), format=fmt)
    return runtime


def _simulatable(actions):
    """_simulate_comms_compute knows compute, sends, receives and send waits: leave out the
    gradient reductions and FSDP actions, and run an overlapped pair as its two parts."""
    out = []
    for a in actions:
        if a is None:
            continue
        if a.sub_actions is not None:
            out.extend(a.sub_actions)
        elif a.computation_type not in (S.REDUCE_GRAD, S.WAIT_REDUCE_GRAD, S.UNSHARD,
                                        S.RESHARD):
            out.append(a)
    return out


@pytest.mark.parametrize("name, p, m, flags", CONFIGS,
                         ids=[f"{c[0]}-p{c[1]}-m{c[2]}-v{c[3]['vpp']}" for c in CONFIGS])
def test_pytorch_loads_validates_lowers_and_simulates_both_forms(name, p, m, flags, tmp_path):
    plan = pipec.compile(UNIFORM, name, pp=p, microbatches=m, **flags)
    stage_to_rank = {s["stage"]: s["rank"] for s in plan.stages}

    # Compute only: PyTorch validates it, places the stages as pipec did, and lowers it to
    # comms itself; its simulator then runs the lowered schedule to the end.
    runtime = _load(plan.export_torch_csv(), tmp_path, plan, "compute_only")
    assert runtime.stage_index_to_group_rank == stage_to_rank
    S._simulate_comms_compute({r: _simulatable(a) for r, a in
                               runtime.pipeline_order_with_comms.items()},
                              lambda s: stage_to_rank[s], plan.num_stages)

    # With comms: PyTorch takes pipec's own send/recv order, waits and reductions as they are.
    runtime = _load(plan.export_torch_csv(comms=True), tmp_path, plan, "compute_comms")
    assert runtime.stage_index_to_group_rank == stage_to_rank
    S._validate_send_waits(runtime.pipeline_order_with_comms)
    S._simulate_comms_compute({r: _simulatable(a) for r, a in
                               runtime.pipeline_order_with_comms.items()},
                              lambda s: stage_to_rank[s], plan.num_stages)


def _cells(csv):
    return [row.split(",") if row else [] for row in csv.split("\r\n")[:-1]]


@pytest.mark.parametrize("name, p, m, flags", [c for c in CONFIGS if c[1] == 4],
                         ids=[f"{c[0]}-p4-m{c[2]}-v{c[3]['vpp']}" for c in CONFIGS if c[1] == 4])
def test_comms_form_places_fsdp_and_reductions_as_pytorchs_lowering_does(name, p, m, flags):
    """UNSHARD/RESHARD and REDUCE_GRAD go where PyTorch's own lowering (_add_unshard_reshard,
    _add_reduce_grad) puts them relative to the compute actions."""
    plan = pipec.compile(UNIFORM, name, pp=p, microbatches=m, **flags)
    compute = _cells(plan.export_torch_csv())
    comms = _cells(plan.export_torch_csv(comms=True))
    for rank in range(p):
        actions = [S._Action.from_str(c) for c in compute[rank]]
        theirs = S._add_reduce_grad(S._add_unshard_reshard(actions), m)
        kept = (S.UNSHARD, S.RESHARD, S.REDUCE_GRAD, S.WAIT_REDUCE_GRAD)
        ours = [a for a in map(S._Action.from_str, comms[rank])
                if a.is_compute_op or a.computation_type in kept]
        assert [str(a) for a in ours] == [str(a) for a in theirs], f"rank {rank}"


def _fake_stages(pp, num_stages, local):
    return [types.SimpleNamespace(num_stages=num_stages, group_size=pp, group_rank=0,
                                  stage_index=s, submod=torch.nn.Identity(), is_first=s == 0,
                                  is_last=s == num_stages - 1) for s in local]


@pytest.mark.parametrize("name, cls, vpp", [
    ("interleaved-1f1b", S.ScheduleInterleaved1F1B, 2),
    ("interleaved-1f1b", S.ScheduleInterleaved1F1B, 3),
    ("zb-v", S.ScheduleZBVZeroBubble, 2),
    ("dualpipe-v", S.ScheduleDualPipeV, 2),
])
def test_compute_rows_are_pytorchs_own_schedule_cell_for_cell(name, cls, vpp):
    """The compute-only CSV equals what PyTorch's own schedule class computes (its idle steps,
    None, left out): the same order, and for dualpipe-v the same overlapped pairs."""
    compared = 0
    for p in (2, 3, 4):
        for m in (2 * p, 3 * p, 4 * p):
            try:
                plan = pipec.compile(UNIFORM, name, pp=p, microbatches=m, vpp=vpp)
            except ValueError:
                continue
            local = [0, 2 * p - 1] if plan.placement == "v-shape" else list(range(0, p * vpp, p))
            theirs = cls(_fake_stages(p, p * vpp, local), n_microbatches=m,
                         loss_fn=lambda out, target: out)
            rows = _cells(plan.export_torch_csv())
            for rank in range(p):
                want = [str(a) for a in theirs.pipeline_order[rank] if a is not None]
                assert rows[rank] == want, f"{name} p={p} m={m} rank {rank}"
            compared += 1
    assert compared >= 3


def test_gpipe_rows_are_pytorchs_gpipe():
    for p, m in ((2, 4), (4, 8), (3, 7)):
        plan = pipec.compile(UNIFORM, "gpipe", pp=p, microbatches=m)
        stage = types.SimpleNamespace(num_stages=p, group_size=p, group_rank=0, stage_index=0,
                                      submod=torch.nn.Identity(), is_first=True, is_last=False)
        theirs = S.ScheduleGPipe(stage, n_microbatches=m,
                                 loss_fn=lambda out, target: out)._get_pipeline_order()
        rows = _cells(plan.export_torch_csv())
        for rank in range(p):
            want = [str(a) for a in theirs[rank] if a is not None and a.is_compute_op]
            assert rows[rank] == want


def test_pytorch_dumps_the_exported_csv_back_byte_for_byte(tmp_path):
    plan = pipec.compile(UNIFORM, "dualpipe-v", pp=3, microbatches=9, vpp=2)
    for comms, fmt in ((False, "compute_only"), (True, "compute_comms")):
        csv = plan.export_torch_csv(comms=comms)
        runtime = _load(csv, tmp_path, plan, fmt)
        out = tmp_path / "dumped.csv"
        runtime._dump_csv(str(out), format=fmt)
        assert out.read_bytes() == csv.encode()


def test_a_pytorch_written_schedule_imports_into_pipec(tmp_path):
    """PyTorch's own ZBV schedule, dumped by PyTorch with comms, is pipec's zb-v."""
    p, m = 4, 8
    theirs = S.ScheduleZBVZeroBubble(_fake_stages(p, 2 * p, [0, 2 * p - 1]), n_microbatches=m,
                                     loss_fn=lambda out, target: out)
    path = tmp_path / "zbv.csv"
    theirs._dump_csv(str(path), format="compute_comms")
    plan = pipec.import_torch_csv(path, UNIFORM)
    assert plan.schedule == "zb-v" and plan.placement == "v-shape" and plan.vpp == 2
    assert plan.json == pipec.compile(UNIFORM, "zb-v", pp=p, microbatches=m, vpp=2).json
