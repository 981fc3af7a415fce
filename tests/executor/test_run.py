"""`hrm run` end to end, the RunSpec it is built from, stopping at EOS and seeded sampling."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from executor.api import prepare_run
from executor.checkpoint import open_checkpoint
from executor.generate import Sampling, generate, sample
from executor.model import MoEModel
from hrm.rules.cpu_gemm import CpuGemmChoice
from planner import MODEL_VERSION
from tests.conftest import record_flags
from tests.executor.conftest import ragged_prompts


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    return path


@pytest.mark.parametrize("name", ["dbrx", "qwen2_moe", "qwen3_moe", "olmoe", "qwen3_moe-dense"])
def test_run_writes_outputs_in_input_order_and_a_record(run_cli, tmp_path, checkpoints, name):
    prompts = ragged_prompts((4, 9, 2), seed=7)
    out = tmp_path / "out.jsonl"
    status, stdout, _ = run_cli(
        "run",
        "--checkpoint",
        checkpoints[name],
        "--prompts",
        write_prompts(tmp_path / "p.jsonl", prompts),
        "--gen-len",
        "5",
        "--output",
        out,
        "--json",
    )
    assert status == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    expected = generate(MoEModel(open_checkpoint(checkpoints[name])), prompts, 5)
    assert [line["output_token_ids"] for line in lines] == expected.output_token_ids
    assert all(line["text"] is None for line in lines)
    record = json.loads(stdout)
    assert record["predicted"] is None and record["hardware"] is None
    assert record["workload"]["prompt_len_max"] == 9 and record["workload"]["gen_len"] == 5
    measured = record["measured"]
    assert measured["generated_tokens"] == 15
    total = measured["prefill_s"] + measured["decode_s"]
    assert measured["throughput_tok_s"] == 15 / total
    assert measured["peak_memory_bytes"]["cpu"] > 0


def test_a_resident_run_is_run_by_the_driver_that_runs_plans(
    run_cli, tmp_path, checkpoints, monkeypatch
):
    """A resident run is the resident policy (everything on the one device, the prompts one
    batch) run by the driver that runs plans: its output goes through OUTPUT.partial, so an
    interrupted run leaves no half-written output and --resume is understood (it used to be
    refused for a resident run); its record names the batch, schedule and engine as a planned
    run's does."""
    import executor.run

    args = ["run", "--checkpoint", checkpoints["dbrx"], "--prompt-len", "4", "--batch", "3",
            "--gen-len", "3", "--quiet", "--batching", "static"]  # fmt: skip
    out = tmp_path / "out.jsonl"
    real = executor.run.generate

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(executor.run, "generate", killed)
    assert run_cli(*args, "--output", out)[0] == 130
    assert list(tmp_path.iterdir()) == []  # nothing had finished: nothing to keep
    monkeypatch.setattr(executor.run, "generate", real)
    status, _, err = run_cli(*args, "--output", out, "--resume")
    assert status == 2 and "out.jsonl.partial does not exist; run without --resume" in err
    status, stdout, err = run_cli(*args, "--output", out, "--json")
    assert status == 0, err
    assert len(out.read_text().splitlines()) == 3 and list(tmp_path.iterdir()) == [out]
    record = json.loads(stdout)
    env = record["environment"]
    assert record["plan"] is None
    assert (env["batch_size"], env["batches_run"], env["schedule"]) == (3, 1, "serial")
    assert env["engine"] == "inline" and not env["stand_in"]


def test_random_prompts_are_seeded(run_cli, tmp_path, checkpoints):
    def outputs(seed):
        out = tmp_path / f"out{seed}.jsonl"
        args = ["--prompt-len", "6", "--batch", "3", "--gen-len", "3", "--seed", seed]
        status, _, _ = run_cli(
            "run", "--checkpoint", checkpoints["mixtral-fused"], *args, "--output", out, "--quiet",
            "--overwrite",
        )  # fmt: skip
        assert status == 0
        return out.read_text()

    assert outputs(1) == outputs(1) != outputs(2)


def test_text_prompts_and_the_checkpoints_eos(run_cli, tmp_path, mixtral_with_tokenizer):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w5 w17 w200"}\n{"prompt_token_ids": [9, 8, 7, 6]}\n')
    out = tmp_path / "out.jsonl"
    status, _, _ = run_cli(
        "run",
        "--checkpoint",
        mixtral_with_tokenizer,
        "--prompts",
        prompts,
        "--gen-len",
        "40",
        "--output",
        out,
        "--quiet",
    )
    assert status == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    for line in lines:
        ids = line["output_token_ids"]
        assert line["text"] == " ".join(f"w{t}" for t in ids)
    spec = prepare_run(mixtral_with_tokenizer, prompts_path=prompts, gen_len=40)
    assert spec.prompts[0] == (5, 17, 200) and spec.arch.eos_token_ids == (3,)


def test_run_spec_describes_the_run(checkpoints, tmp_path):
    """What the planner needs for a prediction, known before any weight is read."""
    spec = prepare_run(checkpoints["mixtral-sharded"], prompt_len=7, batch=5, gen_len=9)
    assert (spec.batch_size, spec.prompt_lens, spec.gen_len) == (5, [7] * 5, 9)
    assert spec.dtype == "float32" and spec.arch.model_type == "mixtral"
    bf16 = prepare_run(checkpoints["dbrx"], prompt_len=2, batch=1, gen_len=1, dtype="bfloat16")
    assert bf16.dtype == "bfloat16" and bf16.arch.rope_theta == 500000


def test_a_sequence_stops_at_its_stop_token_and_the_batch_at_the_last(checkpoints):
    model = MoEModel(open_checkpoint(checkpoints["mixtral-single"]))
    prompts = ragged_prompts((3, 8, 5), seed=8)
    free = generate(model, prompts, 12).output_token_ids
    stop = free[0][2]
    stopped = generate(model, prompts, 12, stop_token_ids=[stop]).output_token_ids
    for full, cut in zip(free, stopped, strict=True):
        end = full.index(stop) + 1 if stop in full else len(full)
        assert cut == full[:end]
    everyone = generate(model, prompts, 12, stop_token_ids=[row[0] for row in free])
    assert everyone.output_token_ids == [row[:1] for row in free]


def test_sampling_is_seeded_and_top_p_narrows_to_greedy(checkpoints):
    model = MoEModel(open_checkpoint(checkpoints["dbrx"]))
    prompts = ragged_prompts((4, 6), seed=9)
    greedy = generate(model, prompts, 10).output_token_ids
    warm = Sampling(temperature=1.5, top_p=0.95, seed=11)
    first = generate(model, prompts, 10, sampling=warm).output_token_ids
    assert generate(model, prompts, 10, sampling=warm).output_token_ids == first
    assert first != greedy
    narrow = Sampling(temperature=1.0, top_p=1e-6, seed=3)
    assert generate(model, prompts, 10, sampling=narrow).output_token_ids == greedy


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, Sampling(temperature=1.0, top_p=0.8), g)) for _ in range(300)}
    assert draws == {0, 1}


def test_hardware_adds_the_planners_prediction_of_this_run(run_cli, checkpoints):
    from hrm.arch import resolve_model
    from hrm.hardware import resolve_hardware
    from hrm.workload import Workload
    from planner import predict_resident_run

    args = ["--prompt-len", "6", "--batch", "3", "--gen-len", "4", "--ignore-eos", "--quiet",
            "--batching", "static"]  # fmt: skip
    checkpoint = checkpoints["mixtral-fused"]
    status, stdout, stderr = run_cli(
        "run", "--checkpoint", checkpoint, *args, "--dtype", "bfloat16", "--hardware", "ci-cpu"
    )
    assert status == 0
    summary = stderr.splitlines()[-1]
    assert summary.startswith("predicted on ci-cpu:") and "against measured" in summary
    # stdout holds the outputs alone: valid JSONL
    assert [len(json.loads(line)["output_token_ids"]) for line in stdout.splitlines()] == [4] * 3
    status, stdout, _ = run_cli(
        "run", "--checkpoint", checkpoint, *args, "--dtype", "bfloat16", "--hardware", "ci-cpu",
        *record_flags(),
    )  # fmt: skip
    record = json.loads(stdout)
    # ci-cpu was measured on another host, so the run probed its GEMM path; the prediction
    # prices the path that ran
    ran = CpuGemmChoice.from_dict(record["environment"]["cpu_gemm"])
    assert ran.source.startswith("probe")
    expected = predict_resident_run(
        resolve_model(checkpoint / "config.json"),
        resolve_hardware("ci-cpu"),
        Workload(prompt_len_mean=6, prompt_len_max=6, gen_len=4),
        batch_size=3,
        dtype="bfloat16",
        cpu_gemm=ran,
    )
    assert record["hardware"] == "ci-cpu"
    assert record["predicted"] == {**expected.predicted.to_dict(), "busy_s": expected.busy_s}
    assert record["environment"]["model_version"] == MODEL_VERSION
    assert record["predicted"]["generated_tokens"] == record["measured"]["generated_tokens"] == 12
    measured = record["measured"]["throughput_tok_s"]
    assert record["prediction_error"] == (
        (record["predicted"]["throughput_tok_s"] - measured) / measured
    )


def test_generation_stops_at_an_eos_the_free_run_produces(
    run_cli, tmp_path, mixtral_with_tokenizer
):
    """The EOS is a token the model really generates: the free run (--ignore-eos) is cut right
    after its first occurrence, and the rest of each line is the free run's."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [5, 17, 200]}\n{"prompt_token_ids": [9, 8, 7, 6]}\n')

    def run(checkpoint, *extra):
        out = tmp_path / "out.jsonl"
        args = ["run", "--checkpoint", checkpoint, "--prompts", prompts, "--gen-len", "12"]
        status, _, err = run_cli(*args, "--output", out, "--quiet", "--overwrite", *extra)
        assert status == 0, err
        return [json.loads(line)["output_token_ids"] for line in out.read_text().splitlines()]

    free = run(mixtral_with_tokenizer, "--ignore-eos")
    eos = free[0][4]  # a token the model generates fifth for the first prompt
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(mixtral_with_tokenizer, checkpoint)
    for name in ("config.json", "generation_config.json"):
        path = checkpoint / name
        if path.exists():
            path.write_text(json.dumps({**json.loads(path.read_text()), "eos_token_id": eos}))
    stopped = run(checkpoint)
    for got, full in zip(stopped, free, strict=True):
        end = full.index(eos) + 1 if eos in full else len(full)
        assert got == full[:end]
    assert len(stopped[0]) == free[0].index(eos) + 1 <= 5 < len(free[0])


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe", "olmoe", "qwen2_moe-dense"])
def test_random_weights_carry_what_each_family_adds(run_cli, checkpoints, name):
    """--random-weights builds the family's own dense tensors (biases, q/k norms, the gated
    shared expert) and its dense layers at their shapes: a run that lacked one would fail."""
    config = checkpoints[name] / "config.json"
    status, stdout, err = run_cli(
        "run", "--model", config, "--random-weights", "--prompt-len", "3", "--batch", "2",
        "--gen-len", "2", "--quiet",
    )  # fmt: skip
    assert status == 0, err
    assert [len(json.loads(line)["output_token_ids"]) for line in stdout.splitlines()] == [2, 2]
