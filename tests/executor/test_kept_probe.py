"""The CPU GEMM path is chosen once per host and kept (hrm.profiling.host_gemm), so greedy
answers do not depend on a timing: every run, rank and resume takes the same path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import hrm.profiling.host_gemm as host_gemm
from hrm.arch import resolve_model
from hrm.rules.cpu_gemm import CpuGemmChoice
from tests.conftest import record_flags

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import dataclasses, sys, torch
from hrm.arch import resolve_model
from hrm.profiling.host_gemm import probe_cpu_gemm
arch = dataclasses.replace(resolve_model("mixtral-8x7b"), hidden_size=256, intermediate_size=512)
torch.manual_seed(int(sys.argv[1]))
w = [torch.randn(512, 256, dtype=torch.bfloat16) for _ in range(4)]
print(probe_cpu_gemm(arch, "bfloat16", w).to_dict()["buckets"])
"""


def _small_arch():
    import dataclasses

    return dataclasses.replace(
        resolve_model("mixtral-8x7b"), hidden_size=256, intermediate_size=512
    )


def test_ranks_probing_at_once_take_one_kept_choice(tmp_path):
    """Two processes (as two ranks) ask at once: one times the paths, the other waits for its
    file, and both take the one choice it keeps."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HRM_CACHE_DIR": str(tmp_path),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROBE, str(seed)],
            env=env,
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for seed in (1, 2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert outs[0][0] == outs[1][0]
    kept = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    assert len(kept) == 1 and kept[0].name.startswith("cpu-gemm-bfloat16-256x512-")


def test_a_kept_probe_is_taken_without_timing_anything(tmp_path, monkeypatch):
    """Once kept, the probe is read, not taken again (a second timing could choose otherwise);
    its record names the file; --cpu-gemm forces a path over the kept curves."""
    monkeypatch.setenv("HRM_CACHE_DIR", str(tmp_path))
    arch = _small_arch()
    weights = [torch.randn(512, 256, dtype=torch.bfloat16) for _ in range(2)]
    first = host_gemm.probe_cpu_gemm(arch, "bfloat16", weights)

    def no_timing(**kwargs):
        raise AssertionError("the kept probe was timed again")

    monkeypatch.setattr(host_gemm, "sweep_matmul", no_timing)
    again = host_gemm.probe_cpu_gemm(arch, "bfloat16", weights)
    assert again == first and str(tmp_path) in again.source
    forced = host_gemm.probe_cpu_gemm(arch, "bfloat16", weights, mode="widened")
    assert forced.paths == ("widened",)
    # another dtype or shape is another probe
    monkeypatch.undo()
    monkeypatch.setenv("HRM_CACHE_DIR", str(tmp_path))
    host_gemm.probe_cpu_gemm(arch, "float32", [w.float() for w in weights])
    assert len([p for p in tmp_path.iterdir() if p.suffix == ".json"]) == 2


def test_an_unreadable_kept_probe_is_taken_again(tmp_path, monkeypatch):
    monkeypatch.setenv("HRM_CACHE_DIR", str(tmp_path))
    arch = _small_arch()
    weights = [torch.randn(512, 256, dtype=torch.bfloat16)]
    path = host_gemm.host_probe_cache("bfloat16", host_gemm.GemmShape(
        model=arch.name, hidden=256, intermediate=512))  # fmt: skip
    path.write_text("{not json")
    choice = host_gemm.probe_cpu_gemm(arch, "bfloat16", weights)
    assert json.loads(path.read_text())["curves"] and choice.paths


def test_greedy_bf16_answers_are_identical_run_to_run(run_cli, checkpoints, tmp_path):
    """Two bf16 runs with no profile (the probe's case): the same answers, bit for bit, and the
    same recorded path."""
    answers, paths = [], []
    for k in range(2):
        out = tmp_path / f"out{k}.jsonl"
        flags = record_flags()
        flags[flags.index("--output") + 1] = str(out)
        status, record, err = run_cli(
            "run", "--checkpoint", checkpoints["mixtral-single"], "--prompt-len", "7", "--batch",
            "5", "--gen-len", "6", "--dtype", "bfloat16", "--ignore-eos", "--quiet", *flags,
        )  # fmt: skip
        assert status == 0, err
        answers.append(out.read_text())
        cpu_gemm = json.loads(record)["environment"]["cpu_gemm"]
        paths.append(CpuGemmChoice.from_dict(cpu_gemm).buckets)
    assert answers[0] == answers[1] and paths[0] == paths[1]


def test_a_probe_kept_before_a_path_this_host_runs_is_taken_again(tmp_path, monkeypatch):
    """A kept probe without the packed curve, on a host that packs, predates the path: it is
    taken again, not read (else the run keeps native where packed is faster)."""
    from hrm.rules.gemm_paths import packing_missing

    monkeypatch.setenv("HRM_CACHE_DIR", str(tmp_path))
    arch = _small_arch()
    weights = [torch.randn(512, 256, dtype=torch.bfloat16) for _ in range(2)]
    first = host_gemm.probe_cpu_gemm(arch, "bfloat16", weights)
    (kept,) = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    data = json.loads(kept.read_text())
    if packing_missing("bfloat16") is None:
        assert "bfloat16_packed" in data["curves"]
    old = {**data, "curves": {k: v for k, v in data["curves"].items() if "packed" not in k}}
    kept.write_text(json.dumps(old))
    again = host_gemm.probe_cpu_gemm(arch, "bfloat16", weights)
    now = json.loads(kept.read_text())
    packs = packing_missing("bfloat16") is None
    assert ("bfloat16_packed" in now["curves"]) == packs  # taken again only where it packs
    assert (now == old) != packs and again.dtype == first.dtype == "bfloat16"
