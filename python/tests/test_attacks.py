"""The Python package against the attacks of issue 44 and the verification of issue 43: no
writer replaces one of the call's inputs (by its path, a symbolic link or a hard link), files are
read only through the project's bounded input rules, every path that yields or runs a schedule
verifies the plan first, and only ValueError / PlanError (TypeError for a wrong Python type where
docs/pytorch.md says so) leave the package."""

import io
import json
import os
import re

import pytest

import pipec
from conftest import example


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "p.json"
    pipec.compile(example("tiny-gpt.json"), "1f1b", pp=2, microbatches=2).save(path)
    return path


def _same_bytes_after(path, call):
    before = path.read_bytes()
    with pytest.raises(ValueError) as err:
        call()
    assert path.read_bytes() == before
    assert "\n" not in str(err.value)
    return str(err.value)


def _alias(plan_file, alias, suffix):
    """The plan file itself, a symbolic link to it or a hard link to it."""
    if alias == "same":
        return plan_file
    target = plan_file.parent / f"{alias}{suffix}"
    if alias == "symlink":
        target.symlink_to(plan_file.name)
    else:
        os.link(plan_file, target)
    return target


@pytest.mark.parametrize("alias", ["same", "symlink", "hardlink"])
def test_simulate_never_writes_its_trace_onto_its_plan(plan_file, alias):
    target = _alias(plan_file, alias, ".json")
    message = _same_bytes_after(plan_file, lambda: pipec.simulate(plan_file, trace=target))
    assert message.startswith(f"trace: {target} is the plan input")


@pytest.mark.parametrize("alias", ["same", "symlink", "hardlink"])
def test_export_torch_csv_never_writes_onto_its_plan(plan_file, alias):
    target = _alias(plan_file, alias, ".csv")
    message = _same_bytes_after(plan_file,
                                lambda: pipec.export_torch_csv(str(plan_file), path=target))
    assert message.startswith(f"path: {target} is the plan input")


def test_outputs_elsewhere_are_still_written(plan_file, tmp_path):
    trace = tmp_path / "t.json"
    pipec.simulate(plan_file, trace=trace)
    assert trace.read_text().startswith("{")
    csv = tmp_path / "s.csv"
    assert pipec.export_torch_csv(plan_file, path=csv).encode() == csv.read_bytes()


def test_import_reads_files_only_by_the_input_rules(tmp_path):
    # /dev/zero would never end: refused before a byte is read, like a directory.
    for path, kind in [("/dev/zero", "a character device"), (str(tmp_path), "is a directory")]:
        with pytest.raises(ValueError, match=kind):
            pipec.import_torch_csv(path, example("uniform-8.json"))
    with pytest.raises(ValueError, match="cannot hold a NUL"):
        pipec.import_torch_csv("sched.csv\0junk", example("uniform-8.json"))
    # Every other reader of the package is the command's own C++ reader.
    for call in [lambda: pipec.load("/dev/zero"), lambda: pipec.validate("/dev/zero"),
                 lambda: pipec.compile("/dev/zero", "1f1b", pp=2, microbatches=2),
                 lambda: pipec.compile(example("uniform-8.json"), "1f1b", pp=2, microbatches=2,
                                       cluster="/dev/zero")]:
        with pytest.raises(ValueError, match="is a character device"):
            call()


def test_import_takes_the_schedule_keyword(tmp_path):
    model = example("uniform-8.json")
    plan = pipec.compile(model, "zb-v", pp=2, vpp=2, microbatches=4)
    csv = tmp_path / "zbv.csv"
    plan.export_torch_csv(path=csv)
    back = pipec.import_torch_csv(csv, model, schedule="zb-v")
    assert back.schedule == "zb-v" and back.json == plan.json
    assert pipec.import_torch_csv(str(csv), model=model, schedule="zb-v").json == plan.json
    with pytest.raises(ValueError, match="--schedule"):
        pipec.import_torch_csv(csv, model, schedule="1f1b")


@pytest.fixture
def tampered(tmp_path):
    """A plan file whose rank 1 receives its first two activations in swapped order: every
    field well formed, the streams not FIFO-matched (gradients would be silently wrong)."""
    plan = pipec.compile(example("tiny-gpt.json"), "1f1b", pp=2, microbatches=4)
    d = plan.to_dict()
    stream = d["ranks"][1]["instructions"]
    a, b = [i for i, x in enumerate(stream) if x["op"] == "recv"][:2]
    stream[a], stream[b] = stream[b], stream[a]
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(d))
    return path


def test_every_path_that_yields_a_schedule_verifies_it(tampered, tmp_path):
    loaded = pipec.load(tampered)  # reading is not running: load checks the format only
    for call in [lambda: pipec.export_torch_csv(tampered),
                 lambda: pipec.export_torch_csv(loaded, comms=True),
                 lambda: loaded.export_torch_csv(path=tmp_path / "s.csv"),
                 lambda: pipec.simulate(tampered),
                 lambda: loaded.trace(),
                 lambda: pipec.validate(tampered)]:
        with pytest.raises(pipec.PlanError, match="FIFO mismatch between rank 0 and rank 1"):
            call()
    assert not (tmp_path / "s.csv").exists()


def test_pipeline_runner_refuses_a_tampered_plan_before_any_step(tampered):
    torch = pytest.importorskip("torch")
    import pipec.torch as pt  # noqa: PLC0415
    layers = [torch.nn.Linear(4, 4) for _ in range(6)]
    # Refused in the constructor, before torch.distributed is even looked at: no step can run.
    with pytest.raises(pipec.PlanError, match="FIFO mismatch"):
        pt.PipelineRunner(tampered, [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)],
                          lambda out, target: out.sum())
    # Cutting a model into stages is no schedule, and works.
    assert len(pt.stage_modules(tampered, layers)) == 2


def test_pipec_torch_names_a_wrong_python_type(plan_file):
    torch = pytest.importorskip("torch")
    import pipec.torch as pt  # noqa: PLC0415
    for layers, where in [(None, "layers: expected a sequence"), (5, "layers: expected"),
                          ([torch.nn.Linear(2, 2), 5], "layers[1]: expected a torch.nn.Module"),
                          (torch.nn.Linear(2, 2), "layers: expected a sequence")]:
        with pytest.raises(TypeError, match=re.escape(where)):
            pt.stage_modules(plan_file, layers)
    with pytest.raises(TypeError, match="rank: expected an int"):
        pt.local_stages(plan_file, "0")


class _Path(os.PathLike):
    def __fspath__(self):
        return 5


class _Unreadable:
    read = 5


def test_wrong_types_raise_only_value_error_or_plan_error(plan_file, tmp_path):
    model = example("uniform-8.json")
    plan = pipec.compile(model, "1f1b", pp=2, microbatches=4)
    values = [None, 5, 1.5, [], {}, object(), b"bytes", True, "", float("nan"), _Path(),
              _Unreadable(), "a\0b", tmp_path / "missing", -1, 10**30, "\n",
              io.StringIO("0F0\n")]
    calls = [
        lambda v: pipec.compile(v, "1f1b", pp=2, microbatches=4),
        lambda v: pipec.compile(model, v, pp=2, microbatches=4),
        lambda v: pipec.compile(model, "1f1b", pp=v, microbatches=4),
        lambda v: pipec.compile(model, "1f1b", pp=2, microbatches=4, vpp=v, cluster=v),
        lambda v: pipec.compile(model, "1f1b", pp=2, microbatches=4, memory_limit=v),
        lambda v: pipec.load(v),
        lambda v: pipec.validate(v),
        lambda v: pipec.simulate(v),
        lambda v: pipec.simulate(plan, trace=v),
        lambda v: pipec.export_torch_csv(v),
        lambda v: pipec.export_torch_csv(plan, path=v),
        lambda v: pipec.import_torch_csv(v, model),
        lambda v: pipec.import_torch_csv("0F0,0B0\n1F0,1B0\n", v),
        lambda v: pipec.import_torch_csv("0F0,0B0\n1F0,1B0\n", model, schedule=v, vpp=v),
        lambda v: plan.instructions(v),
        lambda v: plan.save(v),
    ]
    cwd = os.getcwd()
    os.chdir(tmp_path)  # where a stray output would land
    try:
        for call in calls:
            for v in values:
                try:
                    call(v)
                except (ValueError, pipec.PlanError):
                    pass
    finally:
        os.chdir(cwd)


def test_a_plan_never_writes_onto_a_file_it_was_made_from(plan_file, tmp_path):
    # A Plan remembers the files it came from: loaded from a path, its writers never replace
    # that file (nor its model, cluster or costs file); the same holds through a symlink.
    loaded = pipec.load(plan_file)
    alias = tmp_path / "alias.json"
    alias.symlink_to(plan_file.name)
    for target in (plan_file, alias):
        message = _same_bytes_after(plan_file,
                                    lambda: loaded.export_torch_csv(path=target))
        assert message.startswith(f"path: {target} is the plan input")
        message = _same_bytes_after(plan_file, lambda: pipec.simulate(loaded, trace=target))
        assert message.startswith(f"trace: {target} is the plan input")
        message = _same_bytes_after(plan_file, lambda: loaded.save(target))
        assert message.startswith(f"path: {target} is the plan input")
    model = tmp_path / "model.json"
    model.write_bytes(open(example("uniform-8.json"), "rb").read())
    compiled = pipec.compile(model, "1f1b", pp=2, microbatches=2)
    message = _same_bytes_after(model, lambda: compiled.save(model))
    assert message.startswith(f"path: {model} is the model input")
    # Written elsewhere, as before.
    compiled.save(tmp_path / "elsewhere.json")
    assert pipec.load(tmp_path / "elsewhere.json").json == compiled.json


def test_str_arguments_are_taken_whole_or_refused():
    # A NUL ended the command-line value there (the rest silently dropped); a comma inside a
    # list element made two; a lone surrogate was pybind's generic TypeError; a truthy str
    # such as "no" was taken for True.
    model = example("uniform-8.json")
    for call, message in [
            (lambda: pipec.compile(model, "1f1b\0garbage", pp=2, microbatches=2),
             "schedule: cannot hold a NUL"),
            (lambda: pipec.compile(model, "1f1b", pp=2, microbatches=2, memory_limit="1GiB\0zz"),
             "memory_limit: cannot hold a NUL"),
            (lambda: pipec.compile(model, "1f1b\udcff", pp=2, microbatches=2),
             "schedule: not valid text"),
            (lambda: pipec.plan(model, 2, 8, schedules=["1f1b,zb-v"]),
             "schedules: an element cannot hold a comma"),
            (lambda: pipec.plan(model, 2, 8, schedules=["1f1b\0zz"]),
             "schedules: cannot hold a NUL"),
            (lambda: pipec.import_torch_csv("0F0,0B0\udcff\n", model), "not valid text")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            call()
    plan = pipec.compile(model, "1f1b", pp=2, microbatches=2)
    for call, what in [(lambda: plan.export_torch_csv(comms="no"), "comms"),
                       (lambda: plan.grid(compute_only=1), "compute_only")]:
        with pytest.raises(TypeError, match=f"{what}: expected True or False"):
            call()
