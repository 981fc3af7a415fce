"""The executor's disk tier: a plan that keeps part of the weights on disk runs with the tokens
of the same plan all in host memory, under every schedule and engine mode, reading each layer's
disk part once a pass from its file (removed after), and refuses what it cannot read."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from executor import disk_tier
from executor.checkpoint import open_checkpoint
from executor.generate import generate
from executor.runtime import placed_runtime
from tests.conftest import assert_one_line_error, refuse_o_direct
from tests.executor.conftest import ragged_prompts
from tests.executor.test_offload import between, policy

CPU = torch.device("cpu")
SCHEDULES = [("serial", False), ("overlap", False), ("cgopipe", False), ("gpu-attention", True)]


def _tokens(path, pol, schedule, disk_dir, dtype="float32"):
    checkpoint = open_checkpoint(path, "float32")
    runtime = placed_runtime(checkpoint, pol, schedule, CPU, disk=(str(disk_dir), True))
    try:
        out = generate(runtime, ragged_prompts((5, 9, 3, 7, 6, 2, 8)), 5)
        stats = runtime.engine.stats["disk"]
        disk = runtime.store.disk
        parts = (disk.parts, set(disk.inplace)) if disk is not None else ({}, set())
    finally:
        runtime.close()
    return out.output_token_ids, stats, parts


@pytest.mark.parametrize("mode", ["inline", "threads", "deferred"])
@pytest.mark.parametrize("schedule, attn", SCHEDULES)
def test_disk_tier_gives_the_tokens_of_host_memory(checkpoints, tmp_path, monkeypatch, mode,
                                                   schedule, attn):  # fmt: skip
    """Jittered where the engine runs queues out of order: a read that lands after its copy, or
    a staging refilled while a copy reads it, would change the tokens."""
    monkeypatch.setenv("HRM_ENGINE", mode)
    if mode != "inline":
        monkeypatch.setenv("HRM_ENGINE_JITTER", "7")
    path = checkpoints["mixtral-single"]
    rw = between(open_checkpoint(path, "float32").arch)
    base = policy(attn=attn, rw=rw)
    on_disk = dataclasses.replace(base, weights_disk_fraction=0.6 * (1 - rw))
    memory, idle, _ = _tokens(path, base, schedule, tmp_path)
    disk, stats, (parts, in_place) = _tokens(path, on_disk, schedule, tmp_path)
    assert disk == memory and idle.tasks == 0
    assert in_place == set(parts)  # float32 views of the checkpoint: read from its own file
    passes = 1 + 4  # one batch of 7: prefill, then 4 decode steps past the first token
    assert stats.nbytes == passes * sum(parts.values()) > 0  # each layer's part once a pass
    assert list(tmp_path.iterdir()) == []  # the file is removed


def test_compact_weights_stream_from_disk(checkpoints, tmp_path):
    """int8: the disk part holds the quantized rows, dequantized on the device as ever."""
    path = checkpoints["qwen3_moe"]
    base = policy(rw=0.0, dtype="float32")
    base = dataclasses.replace(base, weight_dtype="int8")
    on_disk = dataclasses.replace(base, weights_disk_fraction=0.5)
    memory, disk = (_tokens(path, p, "cgopipe", tmp_path) for p in (base, on_disk))
    assert memory[0] == disk[0]
    assert disk[2][0] and not disk[2][1]  # quantized: written to the tier's file, not in place


def _disk_plan(run_cli, checkpoint, tmp_path, share=0.5):
    plan_path = tmp_path / "plan.json"
    status, _, err = run_cli("plan", "--model", checkpoint, "--hardware", "ci-cpu",
                             "--gpu-mem", "1MB", "--prompt-len", "8", "--gen-len", "4",
                             "-o", plan_path)  # fmt: skip
    assert status == 0, err
    data = json.loads(plan_path.read_text())
    data["policy"] |= {
        "ffn_on_gpu": True,
        "weights_gpu_fraction": 0.0,
        "weights_disk_fraction": share,
    }
    plan_path.write_text(json.dumps(data))
    return plan_path


def test_hrm_run_reads_the_disk_and_records_it(run_cli, checkpoints, tmp_path):
    ckpt = checkpoints["mixtral-single"]
    runs = {}
    for share in (0.0, 0.5):
        plan = _disk_plan(run_cli, ckpt, tmp_path, share)
        (tmp_path / "disk").mkdir(exist_ok=True)
        out = tmp_path / f"answers-{share}.jsonl"
        status, record, err = run_cli("run", "--checkpoint", ckpt, "--plan", plan,
                                      "--prompt-len", "8", "--batch", "4", "--gen-len", "4",
                                      "--output", out, "--json", "--disk-dir",
                                      tmp_path / "disk")  # fmt: skip
        assert status == 0, err
        runs[share] = (out.read_text(), json.loads(record)["measured"], err)
    (memory, measured, _), (disk, on_disk, err) = runs[0.0], runs[0.5]
    assert disk == memory
    assert "disk" not in measured["link_bytes"] and on_disk["link_bytes"]["disk"] > 0
    assert "disk" in on_disk["busy_fraction"] and "disk tier:" in err
    assert list((tmp_path / "disk").iterdir()) == []


def test_disk_dir_missing_or_refusing_o_direct(run_cli, checkpoints, tmp_path, monkeypatch):
    ckpt = checkpoints["mixtral-single"]
    plan = _disk_plan(run_cli, ckpt, tmp_path)
    base = (
        "run",
        "--checkpoint",
        ckpt,
        "--plan",
        plan,
        "--prompt-len",
        "8",
        "--batch",
        "2",
        "--gen-len",
        "2",
    )
    status, out, err = run_cli(*base, "--disk-dir", tmp_path / "absent")
    assert_one_line_error(status, err, "absent", "no such directory")
    assert out == ""
    refuse_o_direct(monkeypatch, disk_tier)
    status, out, err = run_cli(*base, "--disk-dir", tmp_path, "--quiet")
    assert_one_line_error(status, err, "refuses O_DIRECT", "--disk-buffered")
    status, out, err = run_cli(*base, "--disk-dir", tmp_path, "--disk-buffered", "--quiet")
    assert status == 0, err
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("hrm-disk-")] == []


def test_profile_disk_path_that_does_not_exist(run_cli, checkpoints, tmp_path):
    """Without --disk-dir the file goes where the plan's profile measured its disk: a path that
    is not there is refused in one line, naming it."""
    ckpt = checkpoints["mixtral-single"]
    plan = _disk_plan(run_cli, ckpt, tmp_path)
    data = json.loads(plan.read_text())
    data["machine"]["disk"] = {"read": "2 GB/s", "path": str(tmp_path / "gone")}
    plan.write_text(json.dumps(data))
    run = ("run", "--checkpoint", ckpt, "--plan", plan, "--prompt-len", "8", "--batch", "2",
           "--gen-len", "2")  # fmt: skip
    status, out, err = run_cli(*run)
    assert_one_line_error(status, err, "the profile's disk path", "gone", "--disk-dir")
    assert out == ""
    (tmp_path / "gone").mkdir()
    status, _, err = run_cli(*run, "--quiet")
    assert status == 0, err
    assert list((tmp_path / "gone").iterdir()) == []


def test_the_tiers_own_file_is_unlinked_once_made_and_reads_back(tmp_path):
    """Nothing of the tier's file is left in the directory, even mid-run (a killed run left it
    behind), and what was written reads back O_DIRECT through the open descriptor."""
    from executor.disk_tier import DiskTier

    tier = DiskTier(tmp_path, {0: 10_000, 1: 5_000}, torch.device("cpu"))
    assert list(tmp_path.iterdir()) == []
    data = torch.randint(
        0, 256, (10_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    tier.write(0, data)
    tier.write(1, data[:5_000].flip(0))
    tier.open()
    tier.read(1, 1)
    tier.read(0, 0)
    assert torch.equal(tier.staging[0][:10_000], data)
    assert torch.equal(tier.staging[1][:5_000], data[:5_000].flip(0))
    assert "written to a file in" in tier.describe()
    tier.close()
    tier.close()  # once
    assert list(tmp_path.iterdir()) == []
