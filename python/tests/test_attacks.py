"""The Python package against the attacks of issue 44 and the verification of issue 43: no
writer replaces one of the call's inputs (by its path, a symbolic link or a hard link), files are
read only through the project's bounded input rules, every path that yields or runs a schedule
verifies the plan first, and only ValueError / PlanError (TypeError for a wrong Python type where
docs/pytorch.md says so) leave the package."""

import os

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


@pytest.mark.parametrize("alias", ["same", "symlink", "hardlink"])
def test_simulate_never_writes_its_trace_onto_its_plan(plan_file, alias):
    target = plan_file
    if alias == "symlink":
        target = plan_file.parent / "alias.json"
        target.symlink_to(plan_file.name)
    elif alias == "hardlink":
        target = plan_file.parent / "linked.json"
        os.link(plan_file, target)
    message = _same_bytes_after(plan_file, lambda: pipec.simulate(plan_file, trace=target))
    assert message.startswith(f"trace: {target} is the plan input")


@pytest.mark.parametrize("alias", ["same", "symlink", "hardlink"])
def test_export_torch_csv_never_writes_onto_its_plan(plan_file, alias):
    target = plan_file
    if alias == "symlink":
        target = plan_file.parent / "alias.csv"
        target.symlink_to(plan_file.name)
    elif alias == "hardlink":
        target = plan_file.parent / "linked.csv"
        os.link(plan_file, target)
    message = _same_bytes_after(plan_file,
                                lambda: pipec.export_torch_csv(str(plan_file), path=target))
    assert message.startswith(f"path: {target} is the plan input")


def test_outputs_elsewhere_are_still_written(plan_file, tmp_path):
    trace = tmp_path / "t.json"
    pipec.simulate(plan_file, trace=trace)
    assert trace.read_text().startswith("{")
    csv = tmp_path / "s.csv"
    assert pipec.export_torch_csv(plan_file, path=csv).encode() == csv.read_bytes()
