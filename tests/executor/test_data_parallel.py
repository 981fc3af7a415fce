"""Data-parallel runs on torch.distributed (executor/world.py): torchrun's processes on this CPU,
gloo between them, each group its share of the batches, rank 0 writing the output once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor.world import World, combined, world_from_env
from hrm.errors import HrmError
from tests.executor.conftest import ragged_prompts
from tests.executor.test_run_plan import run_args

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def torchrun(n: int, *args, **popen):
    """`torchrun --nproc-per-node n -m hrm ARGS` on a free local port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
           f"--master-port={_free_port()}", "-m", "hrm", *map(str, args)]  # fmt: skip
    if popen:
        return subprocess.Popen(cmd, env=ENV, cwd=ROOT, text=True, **popen)
    return subprocess.run(cmd, env=ENV, cwd=ROOT, text=True, capture_output=True, timeout=300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hrm(*args):
    cmd = [sys.executable, "-m", "hrm", *map(str, args)]
    return subprocess.run(cmd, env=ENV, cwd=ROOT, text=True, capture_output=True, timeout=300)


def test_two_resident_groups_write_the_one_process_output_once(checkpoints, tmp_path):
    """A resident run's prompts split in two batches, one a group; the output file in input
    order equals one process's; the record is rank 0's, with both ranks' figures."""
    path = checkpoints["mixtral-single"]
    prompts = tmp_path / "prompts.jsonl"
    lines = ragged_prompts([1 + i % 9 for i in range(11)], seed=9)
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in lines))
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    common = ("run", "--checkpoint", path, "--prompts", prompts, "--gen-len", 4, "--quiet",
              "--batching", "static")  # fmt: skip
    assert hrm(*common, "--output", one).returncode == 0
    done = torchrun(2, *common, "--output", two, "--json")
    assert done.returncode == 0, done.stderr
    assert two.read_text() == one.read_text()
    assert not list(tmp_path.glob("*.partial*"))
    record = json.loads(done.stdout)  # rank 0's alone: one JSON document
    env = record["environment"]
    assert (env["world_size"], env["data_parallel"], env["tensor_parallel"]) == (2, 2, 1)
    assert [(r["rank"], r["batches_run"]) for r in env["ranks"]] == [(0, 1), (1, 1)]
    assert record["measured"]["generated_tokens"] == 4 * 11
    assert sum(r["generated_tokens"] for r in env["ranks"]) == 4 * 11


def test_three_planned_groups_print_the_one_process_output(files):
    """A paging plan (N=3, mu=2, the CPU standing in) over ten prompts: four batches over three
    groups, the lines on rank 0's stdout in input order, as one process prints them."""
    path, prompts, plan = files
    one = hrm(*run_args(path, prompts, plan))
    assert one.returncode == 0, one.stderr
    done = torchrun(3, *run_args(path, prompts, plan))
    assert done.returncode == 0, done.stderr
    assert done.stdout == one.stdout and len(done.stdout.splitlines()) == 10


@pytest.mark.parametrize("world", [1, 2])
def test_a_killed_group_resumes_to_the_one_process_output(files, tmp_path, world):
    """SIGTERM to torchrun once group 1 has written a batch: each group's partial file keeps
    what it finished; a run without --resume is refused naming them; --resume in any world
    size (one process, or two groups) ends as an uninterrupted run."""
    path, _, plan = files
    prompts = tmp_path / "many.jsonl"
    lines = ragged_prompts([1 + i % 9 for i in range(480)], seed=9)  # long enough to kill
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in lines))
    whole, out = tmp_path / "whole.jsonl", tmp_path / "out.jsonl"
    assert hrm(*run_args(path, prompts, plan, "--output", whole)).returncode == 0
    proc = torchrun(2, *run_args(path, prompts, plan, "--output", out),
                    stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    second = tmp_path / "out.jsonl.partial.1"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if second.exists() and len(second.read_text().splitlines()) > 1:
            break
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert not out.exists() and second.exists(), err
    again = hrm(*run_args(path, prompts, plan, "--output", out))
    assert again.returncode == 2 and "out.jsonl.partial.1" in again.stderr, again.stderr
    assert "--resume" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    args = run_args(path, prompts, plan, "--output", out, "--resume", "--json")
    done = hrm(*args) if world == 1 else torchrun(world, *args)
    assert done.returncode == 0, done.stderr
    assert out.read_text() == whole.read_text()
    assert json.loads(done.stdout)["environment"]["batches_resumed"] >= 1
    assert not list(tmp_path.glob("out.jsonl.partial*")) and not list(tmp_path.glob("*.lock"))


def test_ranks_started_with_other_prompts_stop_in_one_line(checkpoints, tmp_path):
    """Two ranks of one world (as two nodes would start them), each given its own prompts
    file: both stop before loading, one line each naming the rank that differs, exit 2."""
    path = checkpoints["mixtral-single"]
    port, procs = _free_port(), []
    for rank, lengths in enumerate(((3, 5), (3, 6))):
        prompts = tmp_path / f"prompts{rank}.jsonl"
        prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n"
                                   for p in ragged_prompts(lengths, seed=1)))  # fmt: skip
        env = {**ENV, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        cmd = [sys.executable, "-m", "hrm", "run", "--checkpoint", str(path), "--prompts",
               str(prompts), "--gen-len", "4", "--quiet"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert "rank 1 was started with other prompts, plan or settings" in lines[0]
        assert out == ""


def test_a_resume_with_another_group_count_is_refused(files, tmp_path):
    path, prompts, plan = files
    out = tmp_path / "out.jsonl"
    for part in (0, 1):  # what two groups of a killed run left
        header = {"hrm_partial": {"run": "0123456789abcdef"}}
        (tmp_path / f"out.jsonl.partial.{part}").write_text(json.dumps(header) + "\n")
    done = torchrun(2, *run_args(path, prompts, plan, "--output", out, "--resume"))
    assert done.returncode != 0 and "is from a different run" in done.stderr
    assert not out.exists()


def test_the_world_comes_from_torchruns_environment(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert world_from_env(1) == World()
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "5")
    world = world_from_env(2)
    assert (world.data_parallel, world.group, world.distributed) == (3, 2, True)
    with pytest.raises(HrmError, match="6 processes do not make groups of the plan's "
                                       "tensor_parallel 4"):  # fmt: skip
        world_from_env(4)


def test_the_job_takes_its_slowest_groups_time_and_every_groups_tokens():
    from executor.run import RunResult
    from hrm.record import Measurement

    def result(prefill, decode, tokens, busy):
        return RunResult(
            outputs={tokens: {}}, batches=[(tokens,)], cpu_gemm=None,
            measured=Measurement(prefill_s=prefill, decode_s=decode, generated_tokens=tokens,
                                 link_bytes={"h2d": 1.0, "d2h": 2.0}),
            environment={"busy_s": {"cpu": busy}, "batches_run": 1, "batches_resumed": 0},
        )  # fmt: skip

    job = combined([result(1.0, 3.0, 10, 2.0), result(2.0, 1.0, 30, 3.0)], World(2, 0, 0, 1))
    m = job.measured
    assert (m.prefill_s, m.decode_s, m.generated_tokens) == (1.0, 3.0, 40)
    assert m.busy_fraction == {"cpu": (2.0 + 3.0) / (2 * 4.0)}
    assert m.link_bytes == {"h2d": 2.0, "d2h": 4.0}
    assert job.groups == [[(10,)], [(30,)]] and set(job.outputs) == {10, 30}


def _tp_plan(path: Path, tmp_path: Path, tp: int, schedule: str = "cgopipe") -> Path:
    """A float32 paging plan (N=3, mu=2, CPU attention, nothing resident) over tp GPUs."""
    from executor.checkpoint import read_arch
    from hrm.hardware import resolve_hardware
    from hrm.policy import Policy
    from hrm.workload import Workload
    from planner import predict

    policy = Policy(batch_size=3, micro_batch_size=2, attention_on_gpu=False, ffn_on_gpu=True,
                    weights_gpu_fraction=0.0, kv_gpu_fraction=0.0, weight_dtype="float32",
                    kv_dtype="float32")  # fmt: skip
    workload = Workload(prompt_len_mean=9, prompt_len_max=9, gen_len=4)
    machine = resolve_hardware("4xt4").with_gpu_count(tp)
    plan = predict(read_arch(path), machine, workload, policy, schedule)
    assert plan.tensor_parallel == tp
    return plan.save(tmp_path / f"plan-{schedule}-tp{tp}.json")


@pytest.mark.parametrize(
    ("name", "schedule"),
    [
        ("mixtral-single", "cgopipe"),
        ("dbrx", "serial"),
        ("qwen2_moe", "cgopipe"),
        ("gpt_oss", "cgopipe"),
        ("deepseek_v3", "serial"),
    ],
)
def test_two_tensor_parallel_ranks_give_one_ranks_and_transformers_tokens(
    checkpoints, files, tmp_path, name, schedule
):
    """`hrm run --plan` of a tp 2 plan starts its two ranks itself; each holds half the heads
    and half of every expert's width (Qwen2-MoE: and of its gated shared expert, its q/k/v
    biases; gpt-oss: of its sinks and expert biases, the bias after w2 rank 0's; DeepSeek-V3:
    of kv_b_proj's heads, the latent whole on each), the two all-reduces a layer sum them: the
    tokens of tp 1 and of transformers."""
    from tests.executor.conftest import reference_model
    from tests.executor.test_matches_transformers import reference_generate

    path, prompts, _ = files
    path = checkpoints[name]
    one = hrm(*run_args(path, prompts, _tp_plan(path, tmp_path, 1, schedule)))
    out = tmp_path / "two.jsonl"
    plan = _tp_plan(path, tmp_path, 2, schedule)
    two = hrm(*run_args(path, prompts, plan, "--output", out, "--json"))
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert out.read_text() == one.stdout
    tokens = [json.loads(line)["output_token_ids"] for line in one.stdout.splitlines()]
    lines = [json.loads(line)["prompt_token_ids"] for line in prompts.read_text().splitlines()]
    theirs = [reference_generate(reference_model(path), [p], 4)[0][0] for p in lines]
    assert tokens == theirs
    record = json.loads(two.stdout)
    env = record["environment"]
    assert (env["world_size"], env["tensor_parallel"], env["data_parallel"]) == (2, 2, 1)
    layers = 3
    # two all-reduces a layer a micro-batch a step: 4 batches of 2, 2, 2 and 1 micro-batches
    assert [r["all_reduces"] for r in env["ranks"]] == [2 * layers * 7 * 4] * 2


def test_two_tensor_parallel_ranks_times_two_groups_give_one_processes_output(files, tmp_path):
    path, prompts, _ = files
    one = hrm(*run_args(path, prompts, _tp_plan(path, tmp_path, 1), "--output",
                        tmp_path / "one.jsonl"))  # fmt: skip
    assert one.returncode == 0, one.stderr
    out = tmp_path / "four.jsonl"
    done = torchrun(4, *run_args(path, prompts, _tp_plan(path, tmp_path, 2), "--output", out,
                                 "--json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert out.read_text() == (tmp_path / "one.jsonl").read_text()
    env = json.loads(done.stdout)["environment"]
    assert (env["world_size"], env["tensor_parallel"], env["data_parallel"]) == (4, 2, 2)


def test_a_world_that_is_no_multiple_of_the_plans_tensor_parallel_stops(files, tmp_path):
    """(A tensor_parallel that does not divide the model: test_predictions_on_this_host.py.)"""
    path, prompts, _ = files
    plan = _tp_plan(path, tmp_path, 2)
    done = torchrun(3, *run_args(path, prompts, plan))
    assert done.returncode != 0
    assert "3 processes do not make groups of the plan's tensor_parallel 2" in done.stderr


def test_the_python_api_refuses_a_tensor_parallel_plan(files, tmp_path):
    from hrm.api import generate

    path, _, _ = files
    with pytest.raises(HrmError, match="tensor_parallel 2\\); run it with hrm run, or torchrun"):
        generate(path, [[1, 2, 3]], plan=_tp_plan(path, tmp_path, 2), gen_len=4)


def test_the_shares_of_a_layer_put_together_are_the_layer(checkpoints):
    """Rank r of 2 holds rows r of Q, K, V, w1, w3 and the LM head, and columns r of O and w2;
    side by side they are the whole tensors."""
    import torch

    from executor.checkpoint import open_checkpoint
    from executor.tensor_parallel import shard_checkpoint

    whole = open_checkpoint(checkpoints["qwen2_moe"], "float32")
    parts = [shard_checkpoint(whole, r, 2) for r in range(2)]
    assert parts[0].arch.num_attention_heads == 2 and parts[0].arch.intermediate_size == 48
    w, (a, b) = whole.weights.layers[1], (p.weights.layers[1] for p in parts)
    for name, dim in (("wq", 0), ("wk", 0), ("bv", 0), ("wo", 1), ("shared_w2", 1)):
        assert torch.equal(torch.cat((getattr(a, name), getattr(b, name)), dim), getattr(w, name))
    assert torch.equal(torch.cat((a.experts[3].w2, b.experts[3].w2), 1), w.experts[3].w2)
    assert torch.equal(a.router, w.router) and torch.equal(a.shared_gate, w.shared_gate)
    lm = torch.cat([p.weights.lm_head for p in parts])
    assert torch.equal(lm, whole.weights.lm_head)


def test_more_ranks_on_a_node_than_gpus_stop_before_the_process_group(monkeypatch):
    import torch

    from executor.world import join

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(HrmError, match="4 ranks on this node and 2 GPUs: start at most one"):
        join(World(4, 0, 0, 2), "cuda", "d" * 16)
