"""bench/bench_cpu_peers.py without its peers: hrm against transformers on one small point, and
a peer path that is not what its flag says refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_cpu_peers.py"


def bench(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, BENCH, *map(str, args)], capture_output=True, text=True, timeout=600
    )


def test_hrm_and_transformers_run_the_same_prompts_and_the_table_says_so(tmp_path):
    out = tmp_path / "peers.json"
    done = bench("--shapes", "qwen3_moe", "--points", "2x3", "--rounds", "2", "--layers", "1",
                 "--threads", "2", "--hrm-experts", "loop", "--output", out)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    rows = {r["engine"]: r for r in report["rows"]}
    assert set(rows) == {"hrm", "transformers"}
    for r in rows.values():
        assert r["batch"] == 2 and r["gen_len"] == 3 and r["min"] <= r["tok_s"] <= r["max"]
        assert len(r["first_tokens"]) == 3
    assert "hrm/it" in done.stdout and json.loads(done.stdout.splitlines()[-1]) == report


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--vllm-python", "/no/python"], "--vllm-python /no/python: not an executable"),
        (["--vllm-python", "/etc/hostname"], "--vllm-python /etc/hostname: cannot run it"),
        (["--vllm-python", "/bin/true"], "--vllm-python /bin/true: not 'vllm'-capable"),
        (["--llama-batched-bench", "/bin/true"], "--llama-batched-bench /bin/true: not '-npl'"),
        (["--llama-batched-bench", "/tmp"], "--llama-batched-bench /tmp: not an executable"),
        (["--points", "64x"], "--points '64x': give BATCHxGEN pairs"),
        (["--points", "0x5"], "each point is BATCHxGEN with both at least 1"),
        (["--shapes", "llama"], "--shapes: unknown llama"),
        (["--hrm-experts", "loop,grouped"], "--hrm-experts: unknown grouped"),
    ],
)
def test_a_peer_or_point_that_is_not_what_it_says_is_refused_in_one_line(args, fragment):
    done = bench(*args)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], done.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--vllm-python", "/no/python"], "bench_cpu_attention: --vllm-python /no/python: not an "),
        (["--vllm-python", "/bin/true"], "--vllm-python /bin/true: not 'vllm'-capable"),
    ],
)
def test_the_attention_bench_refuses_a_vllm_that_is_not_one_in_one_line(args, fragment):
    attention = ROOT / "bench" / "bench_cpu_attention.py"
    done = subprocess.run([sys.executable, attention, *args], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], done.stderr


def test_the_batching_bench_refuses_a_profile_that_is_not_there_in_one_line(tmp_path):
    batching = ROOT / "bench" / "bench_batching.py"
    missing = tmp_path / "none.yaml"
    done = subprocess.run([sys.executable, batching, "--hardware", missing], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"bench_batching: --hardware: {missing}: no such file" in lines[0]
