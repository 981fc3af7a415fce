"""A plan that keeps weights on disk, run before the executor has a disk tier."""

from __future__ import annotations

import json

from tests.conftest import assert_one_line_error


def test_run_refuses_a_plan_with_weights_on_disk(run_cli, checkpoints, tmp_path):
    """The executor has no disk tier yet: such a plan is refused in one line, before loading."""
    plan_path = tmp_path / "plan.json"
    status, _, err = run_cli("plan", "--model", checkpoints["mixtral-single"], "--hardware",
                             "ci-cpu", "--gpu-mem", "1MB", "--prompt-len", "8", "--gen-len", "4",
                             "-o", plan_path)  # fmt: skip
    assert status == 0, err
    data = json.loads(plan_path.read_text())
    data["policy"] |= {"weights_gpu_fraction": 0.0, "weights_disk_fraction": 0.25}
    plan_path.write_text(json.dumps(data))
    status, out, err = run_cli("run", "--checkpoint", checkpoints["mixtral-single"], "--plan",
                               plan_path, "--prompt-len", "8", "--batch", "2")  # fmt: skip
    assert_one_line_error(status, err, "25% of the weights on disk", "no disk tier")
    assert out == ""
