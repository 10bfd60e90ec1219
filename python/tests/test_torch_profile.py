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
    # The file the C++ writer wrote is the one returned, and the compiler took its times: each
    # stage's forward is the measured median, its fused backward split into input and weight
    # gradients summing to the measured one.
    written = json.loads((tmp_path / "costs.json").read_text())
    for stage, measured in zip(result["stages"], written["stages"]):
        ops = {o["op"]: o["median_ms"] for o in measured["ops"]}
        assert stage["forward"][0] == pytest.approx(ops["forward"])
        assert stage["backward_input"][0] + stage["backward_weight"][0] == \
            pytest.approx(ops["backward"])
        assert all(o["samples"] == 3 for o in measured["ops"])
    assert result["measured_ms"] > 0 and result["predicted_ms"] > 0
    with capsys.disabled():
        print(f"\npipec.torch.profile, 1f1b on 2 gloo ranks: measured median "
              f"{result['measured_ms']:.2f} ms per step, predicted {result['predicted_ms']:.2f} ms "
              f"({100 * (result['measured_ms'] / result['predicted_ms'] - 1):+.1f}%)")


def test_profile_refuses_bad_arguments():
    plan = pipec.compile(torch_gpt.model_spec(torch_gpt.CONFIG), "1f1b", pp=2, microbatches=4)
    with pytest.raises(ValueError, match="steps: expected an integer of at least 2"):
        pipec.torch.profile(plan, [], None, torch_gpt.loss_fn, None, "x.json", steps=1)
    seq = pipec.compile(torch_gpt.model_spec(torch_gpt.CONFIG), "seq1f1b", pp=2, microbatches=4,
                        seq_splits=2)
    with pytest.raises(ValueError, match="seq_splits=2"):
        pipec.torch.profile(seq, [], None, torch_gpt.loss_fn, None, "x.json")
