"""Where the planner's prediction of a CPU run is right and wrong, operation by operation.

Runs the benchmark model of bench_cpu_vs_transformers.py (the same random Mixtral-shaped
checkpoint, or `--family`'s, batch and lengths, in `--dtype`) with the executor, timing each part
of every layer: dense (norms, QKV and O projections), attention, expert FFN (router included) and
the LM head, per phase (prefill, decode). Beside each it puts the planner's seconds for the same
part (planner.cost.micro_batch_seconds with the all-CPU policy of `hrm run --hardware`) from a quick
`hrm profile --model` of this host at the benchmark model's own shape, or from `--hardware`. The
executor and the planner take the same CPU GEMM path, the one that profile chooses
(hrm.rules.cpu_gemm). The router sits in the planner's dense part (0.02% of the FLOPs). Prints a
table; the last line is JSON; the same JSON goes to reports/.

    python bench/bench_prediction_by_op.py [--quick] [--dtype bfloat16|float32] [--hardware PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench_cpu_vs_transformers import (
    FULL,
    QUICK,
    ROOT,
    bench_config,
    host_cpu_gemm,
    host_description,
    profile_host,
    random_prompts,
    save_checkpoint,
)

from hrm.rules.cpu_gemm import CpuGemmChoice
from planner import MODEL_VERSION

PARTS = ("dense", "attention", "expert ffn", "lm head", "other")


def measure(
    path: Path,
    prompts: list[list[int]],
    gen_len: int,
    dtype: str,
    cpu_gemm,
    repeats: int,
    cpu_moe: str = "loop",
) -> tuple[dict, object]:
    """Seconds per (phase, part): the median over `repeats` executor runs, after a warm-up run
    (single runs on these VMs vary by up to 1.5x); and the GEMM choice as the model took it
    (its experts fused or not, `cpu_moe`)."""
    from executor.checkpoint import open_checkpoint
    from executor.generate import generate, resident_runtime
    from executor.model import MoEModel

    model = MoEModel(open_checkpoint(path, dtype), cpu_gemm, cpu_moe=cpu_moe)
    runtime = resident_runtime(model)  # the engine's resident run, its steps timed below
    generate(runtime, prompts[:2], 2)  # warm-up
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    phase = {"now": "prefill"}

    # post_attention includes experts: its own share is taken out below
    stages = {"pre_attention": "dense", "prefill_attention": "attention",
              "decode_attention": "attention", "post_attention": "post_attention",
              "experts": "expert ffn", "logits": "lm head"}  # fmt: skip
    model.time_stages(stages, seconds, key=lambda part: (phase["now"], part))
    inner_step = runtime.step

    def step(index, tokens, *, last):
        phase["now"] = "decode" if index else "prefill"
        t0 = time.perf_counter()
        out = inner_step(index, tokens, last=last)
        seconds[(phase["now"], "whole")] += time.perf_counter() - t0
        return out

    runtime.step = step
    runs = []
    for _ in range(repeats):
        seconds.clear()
        t0 = time.perf_counter()
        generate(runtime, prompts, gen_len)
        runs.append(_parts(seconds, time.perf_counter() - t0))
    medians = {
        ph: {part: statistics.median(run[ph][part] for run in runs) for part in PARTS}
        for ph in ("prefill", "decode")
    }
    return medians, model.cpu_gemm


def _parts(seconds: dict[tuple[str, str], float], total: float) -> dict:
    """One run's timers as seconds per (phase, part)."""
    result = {}
    for ph in ("prefill", "decode"):
        s = {p: seconds[(ph, p)] for p in ("dense", "attention", "expert ffn", "lm head")}
        s["dense"] += seconds[(ph, "post_attention")] - seconds[(ph, "expert ffn")]
        s["other"] = seconds[(ph, "whole")] - sum(s.values())  # embeddings, rotary, cache
        result[ph] = s
    # sampling and bookkeeping between steps
    steps = seconds[("prefill", "whole")] + seconds[("decode", "whole")]
    result["decode"]["other"] += total - steps
    return result


def predict(path: Path, hw, cpu_gemm, dtype: str, batch: int, prompt_len: int, gen_len: int):
    """The planner's seconds per (phase, part) for the all-CPU run of `hrm run --hardware`."""
    from hrm.arch import resolve_model
    from hrm.workload import Workload
    from planner import predict_resident_run
    from planner.layer_seconds import micro_batch_seconds
    from planner.overheads import step_seconds
    from planner.setting import Setting

    arch = resolve_model(path / "config.json")
    workload = Workload.from_prompt_lens([prompt_len] * batch, gen_len)
    setting = Setting(
        arch=arch,
        hardware=hw,
        workload=workload,
        weight_dtype=dtype,
        kv_dtype=dtype,
        cpu_gemm=cpu_gemm,
        padded_kv_cache=True,  # as predict_resident_run: the executor's cache is left-padded
    )
    mb = micro_batch_seconds(setting, batch)
    layers = arch.num_layers
    # the measured fixed costs (hrm profile's launch_overhead) are charged apart from the parts
    # they belong to, so they get a row of their own; the executor's timers hold them in each part
    step_overhead = step_seconds(setting.hardware.cpu.launch_overhead_for(dtype))
    parts = {
        "dense": layers * mb.cpu_dense,
        "attention": layers * mb.cpu_attention,
        "expert ffn": layers * mb.cpu_ffn,
        "lm head": mb.head_cpu - step_overhead,
        "overhead": layers * mb.cpu_launch + step_overhead,
    }
    result = {
        "prefill": {p: float(v[0]) for p, v in parts.items()},
        "decode": {p: float(v[1:].sum()) for p, v in parts.items()},
    }
    plan = predict_resident_run(
        arch, hw, workload, batch_size=batch, dtype=dtype, cpu_gemm=cpu_gemm
    )
    # the parts must add up to the prediction hrm run reports
    assert abs(sum(result["prefill"].values()) - plan.predicted.prefill_s) < 1e-9
    assert abs(sum(result["decode"].values()) - plan.predicted.decode_s) < 1e-9
    return result


def _check_memory(config, batch: int, prompt_len: int, gen_len: int, dtype: str) -> None:
    """The run's host memory (the planner's count) against what is available, before the
    checkpoint is written: one line and exit status 2 when it would not fit."""
    from hrm.arch import ModelArch
    from hrm.cli.memory_check import check_runs
    from hrm.errors import HrmError

    arch = ModelArch.from_hf_config(config.to_dict(), name="bench")
    try:
        check_runs(arch, [(batch, prompt_len, gen_len, dtype)], what="the bench run",
                   layers_flag=False)  # fmt: skip
    except HrmError as exc:
        print(f"bench_prediction_by_op: {exc}; give a smaller --batch", file=sys.stderr)
        raise SystemExit(2) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick shape of the CPU bench")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--cpu-moe", choices=("loop", "fused", "auto"), default="loop",
                        help="the routed experts (--cpu-moe), priced as they ran")  # fmt: skip
    parser.add_argument(
        "--family",
        choices=("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v2"),
        default="mixtral",
        help="model family (bench_cpu_vs_transformers.py's shapes)",
    )
    parser.add_argument("--hardware", help="profile to predict with (default: profile this host)")
    parser.add_argument("--repeats", type=int, default=3, help="runs to take the median of (3)")
    parser.add_argument("--output", help="JSON to write (reports/bench_prediction_by_op.json)")
    for name in ("batch", "prompt_len", "gen_len"):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, help=f"override the bench shape's {name}")
    args = parser.parse_args()
    name = "bench_prediction_by_op" + ("_quick" if args.quick else "")
    name += "" if args.dtype == "bfloat16" else f"_{args.dtype}"
    name += "" if args.family == "mixtral" else f"_{args.family}"
    output = Path(args.output or ROOT / "reports" / f"{name}.json")
    shape = dict(QUICK if args.quick else FULL)
    shape.update(
        {k: getattr(args, k) for k in ("batch", "prompt_len", "gen_len") if getattr(args, k)}
    )
    batch, prompt_len, gen_len = shape["batch"], shape["prompt_len"], shape["gen_len"]
    config = bench_config(args.family, shape["hidden"], shape["width"], shape["layers"])
    _check_memory(config, batch, prompt_len, gen_len, args.dtype)
    prompts = random_prompts(batch, prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_checkpoint(config, Path(tmp) / "bench")
        hardware = args.hardware or str(profile_host(path / "config.json", Path(tmp) / "host.yaml"))
        profile, cpu_gemm = host_cpu_gemm(path, hardware, args.dtype)
        measured, cpu_gemm = measure(path, prompts, gen_len, args.dtype, cpu_gemm, args.repeats,
                                     args.cpu_moe)  # fmt: skip
        predicted = predict(path, profile, cpu_gemm, args.dtype, batch, prompt_len, gen_len)
        # the same profile with every GEMM priced at the expert's w1 curve, as before the
        # profile timed each shape: what the shape curves change, against the same measurement
        w1_only = dataclasses.replace(
            profile, cpu=dataclasses.replace(profile.cpu, gemm_shape_curves={})
        )
        before = predict(path, w1_only, cpu_gemm, args.dtype, batch, prompt_len, gen_len)
    rows = []
    for ph in ("prefill", "decode"):
        for part in (*PARTS, "overhead"):
            m = measured[ph].get(part, 0.0)  # the executor cannot time its overhead apart
            p = predicted[ph].get(part, 0.0)
            w1 = before[ph].get(part, 0.0)
            rows.append(
                {
                    "phase": ph,
                    "part": part,
                    "measured_s": m,
                    "predicted_s": p,
                    "error": (p - m) / m if m else None,
                    "w1_curve_only_s": w1,
                    "w1_curve_only_error": (w1 - m) / m if m else None,
                }
            )
    keys = ("measured_s", "predicted_s", "w1_curve_only_s")
    totals = {key: sum(r[key] for r in rows) for key in keys}
    totals["error"] = totals["predicted_s"] / totals["measured_s"] - 1
    totals["w1_curve_only_error"] = totals["w1_curve_only_s"] / totals["measured_s"] - 1
    result = {
        "model": {**shape, "dtype": args.dtype},
        "repeats": args.repeats,
        "model_version": MODEL_VERSION,
        "hardware": args.hardware or "this host, profiled quickly at the bench model's shape",
        "host": host_description(),
        "cpu_gemm": cpu_gemm.to_dict(),
        "rows": rows,
        "totals": totals,
    }
    print(format_table(result))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(totals))


def format_table(r: dict) -> str:
    lines = [
        f"{r['model']['dtype']}; host: {r['host']}; profile: {r['hardware']}",
        f"CPU GEMM: {CpuGemmChoice.from_dict(r['cpu_gemm']).describe()}",
        f"{'phase':<9}{'part':<12}{'measured s':>12}{'predicted s':>12}{'error':>8}"
        f"{'w1 curve only s':>17}{'error':>8}",
    ]
    for row in r["rows"]:
        lines.append(
            f"{row['phase']:<9}{row['part']:<12}{row['measured_s']:>12.3f}"
            f"{row['predicted_s']:>12.3f}{_pct(row['error']):>8}"
            f"{row['w1_curve_only_s']:>17.3f}{_pct(row['w1_curve_only_error']):>8}"
        )
    t = r["totals"]
    lines.append(
        f"{'total':<21}{t['measured_s']:>12.3f}{t['predicted_s']:>12.3f}{_pct(t['error']):>8}"
        f"{t['w1_curve_only_s']:>17.3f}{_pct(t['w1_curve_only_error']):>8}"
    )
    return "\n".join(lines)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


if __name__ == "__main__":
    main()
