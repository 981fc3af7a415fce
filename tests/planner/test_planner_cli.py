"""`hrm plan` end to end: the table, the JSON, the plan file, sweeps, and one-line errors."""

from __future__ import annotations

import json

import pytest
import yaml

from hrm.plan import Plan
from tests.conftest import assert_one_line_error

MTBENCH = [
    "--model",
    "mixtral-8x7b",
    "--hardware",
    "l4",
    "--prompt-len",
    "77",
    "--max-prompt-len",
    "418",
    "--gen-len",
    "32",
]


def write_cpu_only_profile(tmp_path, flops: dict):
    """A profile YAML with a CPU (512 GB, 100 GB/s, `flops`) and no GPU."""
    profile = tmp_path / "cpu.yaml"
    cpu = {"name": "x86", "memory": "512 GB", "memory_bandwidth": "100 GB/s", "flops": flops}
    profile.write_text(yaml.safe_dump({"name": "cpu-box", "source": "measured", "cpu": cpu}))
    return profile


def test_json_has_the_promised_keys(run_cli):
    status, out, err = run_cli("plan", *MTBENCH, "--json", "--top", "2")
    assert status == 0, err
    data = json.loads(out)
    assert set(data["policy"]) >= {
        "batch_size",
        "micro_batch_size",
        "attention_on_gpu",
        "ffn_on_gpu",
        "weights_gpu_fraction",
        "kv_gpu_fraction",
    }
    assert set(data["predicted"]) >= {"throughput_tok_s", "prefill_s", "decode_s"}
    assert data["memory"]["gpu_bytes"] <= data["memory"]["gpu_capacity_bytes"]
    assert data["memory"]["cpu_bytes"] <= data["memory"]["cpu_capacity_bytes"]
    assert data["bottleneck"] and data["binding_memory"]
    assert [b["name"] for b in data["baselines"]] == ["flexgen-like", "deepspeed-like"]
    assert all(b["predicted"]["throughput_tok_s"] > 0 for b in data["baselines"])
    assert len(data["top"]) == 2


def test_table_and_plan_file(run_cli, tmp_path):
    out_path = tmp_path / "plan.json"
    status, out, err = run_cli("plan", *MTBENCH, "--padding", "-o", out_path)
    assert status == 0, err
    for word in (
        "policy",
        "tok/s",
        "prefill",
        "busy",
        "GPU memory",
        "CPU memory",
        "binds",
        "flexgen-like",
        "deepspeed-like",
    ):
        assert word in out
    plan = Plan.load(out_path)
    assert plan.workload.padding and plan.schedule == "cgopipe"


def test_cpu_only_profile(run_cli, tmp_path):
    profile = write_cpu_only_profile(tmp_path, {"float32": "2 TFLOP/s", "bfloat16": "2 TFLOP/s"})
    status, out, err = run_cli(
        "plan",
        "--model",
        "mixtral-8x7b",
        "--hardware",
        profile,
        "--prompt-len",
        "64",
        "--gen-len",
        "16",
        "--json",
    )
    assert status == 0, err
    data = json.loads(out)
    assert not data["policy"]["ffn_on_gpu"] and not data["policy"]["attention_on_gpu"]
    assert data["baselines"] == []


def test_sweep_writes_table_and_png(run_cli, tmp_path):
    png = tmp_path / "pcie.png"
    status, out, err = run_cli(
        "plan",
        *MTBENCH,
        "--sweep",
        "pcie",
        "--sweep-values",
        "8 GB/s,16 GB/s,32 GB/s",
        "--plot",
        png,
        "--json",
    )
    assert status == 0, err
    data = json.loads(out)
    values = [p["throughput_tok_s"] for p in data["points"]]
    assert values == sorted(values) and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--gen-len", "-3"], ["--gen-len"]),
        (["--gen-len", "0"], ["--gen-len"]),
        (["--prompt-len", "-5"], ["--prompt-len"]),
        (["--max-prompt-len", "10"], ["exceeds the maximum"]),
        (["--cpu-mem", "lots"], ["--cpu-mem", "cannot read"]),
        (["--gpu-mem", "0 GB"], ["--gpu-mem", "positive"]),
        (["--schedule", "zigzag"], ["invalid choice", "zigzag"]),
        (["--top", "0"], ["--top"]),
        (["--max-batch-size", "0"], ["--max-batch-size"]),
        (["--cpu-mem", "40 GB", "--disk-tier", "off"], ["CPU memory", "short"]),
        (["--cpu-mem", "1 GB"], ["CPU memory", "short"]),  # even with every weight on disk
        (["--disk-tier", "sometimes"], ["invalid choice", "sometimes"]),
    ],
)
def test_bad_input_is_one_line_and_leaves_no_file(run_cli, tmp_path, args, fragments):
    out_path = tmp_path / "plan.json"
    base = {a: b for a, b in zip(MTBENCH[::2], MTBENCH[1::2], strict=True)}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = [x for kv in base.items() for x in kv]
    status, _, err = run_cli("plan", *argv, "-o", out_path)
    assert_one_line_error(status, err, *fragments)
    assert list(tmp_path.iterdir()) == []


def test_sweep_on_a_cpu_only_machine_is_refused(run_cli, tmp_path):
    profile = write_cpu_only_profile(tmp_path, {"float32": "2 TFLOP/s"})
    status, _, err = run_cli(
        "plan",
        "--model",
        "mixtral-8x7b",
        "--hardware",
        profile,
        "--prompt-len",
        "64",
        "--gen-len",
        "16",
        "--sweep",
        "gpu-mem",
        "--plot",
        tmp_path / "x.png",
    )
    assert_one_line_error(status, err, "no GPU")
    assert not (tmp_path / "x.png").exists()


def test_a_named_policy_is_predicted_beside_the_best(run_cli):
    args = ["plan", "--model", "mixtral-8x7b", "--hardware", "l4", "--prompt-len", "77",
            "--max-prompt-len", "418", "--gen-len", "128"]  # fmt: skip
    status, out, _ = run_cli(*args, "--policy", "N=504,mu=36,attn=cpu,ffn=gpu,w=0,kv=0")
    assert status == 0
    named = out.split("named policy (fits)")[1]
    assert "N=504 mu=36 attention CPU FFN GPU weights-on-GPU 0%" in named
    assert "x the best's throughput" in out and "binds" in named
    status, out, _ = run_cli(*args, "--policy", "N=504,mu=36", "--json")
    data = json.loads(out)
    from hrm.arch import resolve_model
    from hrm.hardware import resolve_hardware
    from hrm.policy import Policy
    from hrm.workload import Workload
    from planner import predict

    expected = predict(
        resolve_model("mixtral-8x7b"),
        resolve_hardware("l4"),
        Workload(prompt_len_mean=77, prompt_len_max=418, gen_len=128),
        Policy(
            batch_size=504,
            micro_batch_size=36,
            attention_on_gpu=False,
            ffn_on_gpu=True,
            weights_gpu_fraction=0.0,
            kv_gpu_fraction=0.0,
        ),  # fmt: skip
    )
    assert data["named_policy"]["predicted"] == expected.predicted.to_dict()
    assert data["named_policy"]["shortfall"] == {}
    # a what-if that does not fit is not an error: it says which memory is short, and by how much
    status, out, _ = run_cli(*args, "--policy", "N=8192,mu=64,attn=gpu,ffn=gpu,w=1,kv=1")
    assert status == 0
    assert "named policy (DOES NOT FIT: GPU memory" in out and "short" in out


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("N=10,mu=2,speed=3", "unknown key 'speed'"),
        ("N=10,mu=2,w=1.5", "w must be a fraction between 0 and 1"),
        ("N=10,mu=20", "mu=20 is larger than N=10"),
        ("mu=2", "give N"),
        ("N=10,mu=2,attn=tpu", "attn must be cpu or gpu"),
        ("N=ten,mu=2", "N must be a positive integer"),
        ("N=10,mu=2,attn=gpu,ffn=cpu", "attention on the GPU needs the layers"),
    ],
)
def test_a_malformed_policy_is_one_line(run_cli, text, fragment):
    status, out, err = run_cli(
        "plan", "--model", "mixtral-8x7b", "--hardware", "l4", "--prompt-len", "77",
        "--gen-len", "128", "--policy", text,
    )  # fmt: skip
    assert_one_line_error(status, err, fragment)
    assert out == ""


@pytest.mark.parametrize(
    ("points", "fragment"),
    [
        ([[16, "10 GFLOP/s"], [4, "5 GFLOP/s"]], "strictly increasing sizes"),
        ([[1, "10 GFLOP/s"], [4, "0 GFLOP/s"]], "FLOP rate must be positive"),
        ([[0, "10 GFLOP/s"], [4, "5 GFLOP/s"]], "size must be positive"),
    ],
)
def test_a_curve_out_of_order_or_not_positive_is_one_line(run_cli, tmp_path, points, fragment):
    path = write_cpu_only_profile(tmp_path, {"float32": "100 GFLOP/s"})
    data = yaml.safe_load(path.read_text())
    data["cpu"]["matmul_curves"] = {"float32": points}
    path.write_text(yaml.safe_dump(data))
    status, out, err = run_cli(
        "plan",
        "--model",
        "mixtral-8x7b",
        "--hardware",
        path,
        "--prompt-len",
        "77",
        "--gen-len",
        "8",
    )
    assert_one_line_error(status, err, "matmul_curves: float32", fragment)
    assert out == ""


def test_max_batch_size_caps_the_batch(run_cli, tmp_path):
    free = json.loads(run_cli("plan", *MTBENCH, "--json")[1])["policy"]["batch_size"]
    status, out, err = run_cli(
        "plan", *MTBENCH, "--max-batch-size", "48", "-o", tmp_path / "p.json"
    )
    assert status == 0, err
    plan = Plan.load(tmp_path / "p.json")
    assert free > 48 >= plan.policy.batch_size
    assert plan.geometry["num_layers"] == 32  # the plan records the geometry it was made for
