"""Item 6: pipec.torch.profile measures the user's own stage modules under PyTorch (gloo, 2
processes) and writes measured costs that `pipec compile --costs` takes; the plan compiled from
them is trained with PipelineRunner and its predicted step is reported against the measured one.
"""

import json
import os

import pytest

torch = pytest.importorskip("torch")

import pipec  # noqa: E402
import pipec.torch  # noqa: E402
import torch_gpt  # noqa: E402
import torch_workers  # noqa: E402
from conftest import run_ranks  # noqa: E402


def test_profile_feeds_the_compiler_and_reports_predicted_against_measured(tmp_path, capsys):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cfg = dict(torch_gpt.CONFIG)
    run_ranks(torch_workers.profile_and_train, 2,
              (2, str(tmp_path / "init"), str(tmp_path), cfg, 5), "profiling ranks")
    result = json.loads((tmp_path / "result.json").read_text())
    costs = result["costs"]
    assert costs["format"] == "pipecost/1"
    assert costs["measured_on"]["backend"] == "torch"
    assert [s["stage"] for s in costs["stages"]] == [0, 1]
    # The file the C++ writer wrote is the one returned, and the compiler took its times. Stage
    # 0's input is tokens (no input gradient): its backward is fused and the compiler splits it.
    # Stage 1's input is stage 0's output: its input gradient is measured apart (B) and the
    # weight gradient is the fused backward less B (W), as a zero-bubble schedule runs them.
    written = json.loads((tmp_path / "costs.json").read_text())
    assert written == costs
    first, second = ({o["op"]: o for o in s["ops"]} for s in written["stages"])
    assert set(first) == {"forward", "backward"}
    assert set(second) == {"forward", "backward_input", "backward_weight"}
    assert all(o["samples"] == 3 for s in written["stages"] for o in s["ops"])
    plan0, plan1 = result["stages"]
    assert plan0["forward"][0] == pytest.approx(first["forward"]["median_ms"])
    assert plan0["backward_input"][0] + plan0["backward_weight"][0] == \
        pytest.approx(first["backward"]["median_ms"])
    assert plan1["forward"][0] == pytest.approx(second["forward"]["median_ms"])
    assert plan1["backward_input"][0] == pytest.approx(second["backward_input"]["median_ms"])
    assert plan1["backward_weight"][0] == pytest.approx(second["backward_weight"]["median_ms"])
    assert second["backward_input"]["median_ms"] > 0
    # The one boundary, measured as round trips of the tensor that crosses it: one entry per
    # direction with the plan's size for it, and the plan's transfer times are those.
    assert [(m["kind"], m["bytes"]) for m in written["messages"]] == \
        [("activation", plan0["output_bytes"][0]), ("gradient", plan0["output_bytes"][0])]
    assert all(m["samples"] == 2 * 3 and m["median_ms"] > 0 for m in written["messages"])
    assert plan0["activation_transfer_time"][0] == \
        pytest.approx(written["messages"][0]["median_ms"])
    assert plan1["gradient_transfer_time"][0] == \
        pytest.approx(written["messages"][1]["median_ms"])
    # The optimizer: one entry per rank, and the user's parameters are as they were.
    assert [r["rank"] for r in written["ranks"]] == [0, 1]
    assert all(r["optimizer"]["samples"] == 3 and r["peak_memory_bytes"] > 0
               for r in written["ranks"])
    assert result["restored"]
    assert result["measured_ms"] > 0 and result["predicted_ms"] > 0
    with capsys.disabled():
        print(f"\npipec.torch.profile, 1f1b on 2 gloo ranks: measured median "
              f"{result['measured_ms']:.2f} ms per step, predicted {result['predicted_ms']:.2f} ms "
              f"({100 * (result['measured_ms'] / result['predicted_ms'] - 1):+.1f}%)")


def test_profile_refuses_bad_arguments():
    plan = pipec.compile(torch_gpt.model_spec(torch_gpt.CONFIG), "1f1b", pp=2, microbatches=4)
    with pytest.raises(ValueError, match="steps: expected an integer of at least 2"):
        pipec.torch.profile(plan, [], None, torch_gpt.loss_fn, None, "x.json", steps=1)
    with pytest.raises(TypeError, match="optimizer: expected a callable"):
        pipec.torch.profile(plan, [], None, torch_gpt.loss_fn, None, "x.json", optimizer=3)
    seq = pipec.compile(torch_gpt.model_spec(torch_gpt.CONFIG), "seq1f1b", pp=2, microbatches=4,
                        seq_splits=2)
    with pytest.raises(ValueError, match="seq_splits=2"):
        pipec.torch.profile(seq, [], None, torch_gpt.loss_fn, None, "x.json")


def test_profile_never_writes_onto_its_plan(tmp_path):
    # The plan given by its path (or a link to it) is one of the call's inputs: refused before
    # anything is measured, the plan unchanged.
    plan_file = tmp_path / "p.json"
    pipec.compile(torch_gpt.model_spec(torch_gpt.CONFIG), "1f1b", pp=2, microbatches=4).save(
        str(plan_file))
    before = plan_file.read_bytes()
    (tmp_path / "alias.json").symlink_to("p.json")
    for target in (plan_file, tmp_path / "alias.json"):
        with pytest.raises(ValueError, match=f"path: {target} is the plan input"):
            pipec.torch.profile(str(plan_file), [], None, torch_gpt.loss_fn, None, str(target))
    assert plan_file.read_bytes() == before
