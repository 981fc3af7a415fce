"""Where the planner's prediction of a CPU run is right and wrong, operation by operation.

Runs the benchmark model of bench_cpu_vs_transformers.py (the same random bf16 Mixtral-shaped
checkpoint, batch and lengths) with the executor, timing each part of every layer: dense
(norms, QKV and O projections), attention, expert FFN (router included) and the LM head, per phase
(prefill, decode). Beside each it puts the planner's seconds for the same part
(planner.cost.micro_batch_seconds with the all-CPU policy of `hrm run --hardware`), twice: from
`--hardware` (ci-cpu, whose GEMM curves were timed at Mixtral 8x7B's expert shape) and from a
quick `hrm profile --model` of this machine at the benchmark model's own shape, so that what the
shape explains is told apart from what the model leaves out. The router sits in the planner's
dense part (0.02% of the FLOPs). Prints a table; the last line is JSON; the same JSON goes to
reports/.

    python bench/bench_prediction_by_op.py [--quick] [--hardware PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench_cpu_vs_transformers import (
    FULL,
    QUICK,
    ROOT,
    mixtral_config,
    random_prompts,
    save_checkpoint,
)

PARTS = ("dense", "attention", "expert ffn", "lm head", "other")


def measure(path: Path, prompts: list[list[int]], gen_len: int) -> dict:
    """Seconds per (phase, part) of one executor run, after a warm-up run."""
    from executor.checkpoint import open_checkpoint
    from executor.generate import generate
    from executor.model import MoEModel

    model = MoEModel(open_checkpoint(path, "bfloat16"))
    generate(model, prompts[:2], 2)  # warm-up
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    phase = {"now": "prefill"}

    def timed(name: str, part: str | None, sets_phase: str | None = None):
        inner = getattr(model, name)

        def wrapper(*args, **kwargs):
            if sets_phase:
                phase["now"] = sets_phase
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            elapsed = time.perf_counter() - t0
            seconds[(phase["now"], part or name)] += elapsed
            return out

        setattr(model, name, wrapper)

    # post_attention includes experts: its own share is taken out below
    for name, part in (
        ("pre_attention", "dense"),
        ("prefill_attention", "attention"),
        ("decode_attention", "attention"),
        ("post_attention", "post_attention"),
        ("experts", "expert ffn"),
        ("logits", "lm head"),
    ):
        timed(name, part)
    timed("prefill", "whole", sets_phase="prefill")
    timed("decode", "whole", sets_phase="decode")
    t0 = time.perf_counter()
    generate(model, prompts, gen_len)
    total = time.perf_counter() - t0
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


def predict(path: Path, hardware: str, batch: int, prompt_len: int, gen_len: int) -> dict:
    """The planner's seconds per (phase, part) for the all-CPU run of `hrm run --hardware`."""
    from hrm.arch import resolve_model
    from hrm.hardware import resolve_hardware
    from hrm.workload import Workload
    from planner import predict_resident_run
    from planner.cost import Setting, micro_batch_seconds

    arch, hw = resolve_model(path / "config.json"), resolve_hardware(hardware)
    workload = Workload.from_prompt_lens([prompt_len] * batch, gen_len)
    setting = Setting(
        arch=arch, hardware=hw, workload=workload, weight_dtype="bfloat16", kv_dtype="bfloat16"
    )
    mb = micro_batch_seconds(setting, batch)
    layers = arch.num_layers
    parts = {
        "dense": layers * mb.cpu_dense,
        "attention": layers * mb.cpu_attention,
        "expert ffn": layers * mb.cpu_ffn,
        "lm head": mb.head_cpu,
    }
    result = {
        "prefill": {p: float(v[0]) for p, v in parts.items()},
        "decode": {p: float(v[1:].sum()) for p, v in parts.items()},
    }
    plan = predict_resident_run(arch, hw, workload, batch_size=batch, dtype="bfloat16")
    # the parts must add up to the prediction hrm run reports
    assert abs(sum(result["prefill"].values()) - plan.predicted.prefill_s) < 1e-9
    assert abs(sum(result["decode"].values()) - plan.predicted.decode_s) < 1e-9
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick shape of the CPU bench")
    parser.add_argument("--hardware", default="ci-cpu", help="profile to predict with (ci-cpu)")
    parser.add_argument("--output", help="JSON to write (reports/bench_prediction_by_op.json)")
    args = parser.parse_args()
    name = "bench_prediction_by_op_quick" if args.quick else "bench_prediction_by_op"
    output = Path(args.output or ROOT / "reports" / f"{name}.json")
    shape = QUICK if args.quick else FULL
    batch, prompt_len, gen_len = shape["batch"], shape["prompt_len"], shape["gen_len"]
    prompts = random_prompts(batch, prompt_len)
    with tempfile.TemporaryDirectory() as tmp:
        config = mixtral_config(shape["hidden"], shape["width"], shape["layers"])
        path = save_checkpoint(config, Path(tmp) / "bench")
        shaped = Path(tmp) / "at-this-shape.yaml"
        subprocess.run(
            [sys.executable, "-m", "hrm", "profile", "--quick", "--device", "cpu", "--quiet"]
            + ["--model", str(path / "config.json"), "-o", str(shaped)],
            check=True,
            cwd=ROOT,
        )
        measured = measure(path, prompts, gen_len)
        predicted = predict(path, args.hardware, batch, prompt_len, gen_len)
        predicted_shaped = predict(path, str(shaped), batch, prompt_len, gen_len)
    rows = []
    for ph in ("prefill", "decode"):
        for part in PARTS:
            m = measured[ph][part]
            p, q = predicted[ph].get(part, 0.0), predicted_shaped[ph].get(part, 0.0)
            rows.append(
                {
                    "phase": ph,
                    "part": part,
                    "measured_s": m,
                    "predicted_s": p,
                    "error": (p - m) / m if m else None,
                    "predicted_at_shape_s": q,
                    "error_at_shape": (q - m) / m if m else None,
                }
            )
    totals = {
        key: sum(r[key] for r in rows)
        for key in ("measured_s", "predicted_s", "predicted_at_shape_s")
    }
    result = {"model": shape, "hardware": args.hardware, "rows": rows, "totals": totals}
    print(format_table(result))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(totals))


def format_table(r: dict) -> str:
    lines = [
        f"{'':<21}{'':>10}{r['hardware']:>20}{'profiled at this shape':>24}",
        f"{'phase':<9}{'part':<12}{'measured s':>10}{'predicted s':>12}{'error':>8}"
        f"{'predicted s':>16}{'error':>8}",
    ]
    for row in r["rows"]:
        lines.append(
            f"{row['phase']:<9}{row['part']:<12}{row['measured_s']:>10.3f}"
            f"{row['predicted_s']:>12.3f}{_pct(row['error']):>8}"
            f"{row['predicted_at_shape_s']:>16.3f}{_pct(row['error_at_shape']):>8}"
        )
    t = r["totals"]
    m = t["measured_s"]
    lines.append(
        f"{'total':<21}{m:>10.3f}{t['predicted_s']:>12.3f}{_pct(t['predicted_s'] / m - 1):>8}"
        f"{t['predicted_at_shape_s']:>16.3f}{_pct(t['predicted_at_shape_s'] / m - 1):>8}"
    )
    return "\n".join(lines)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


if __name__ == "__main__":
    main()
