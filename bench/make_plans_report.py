"""Write reports/plans.md and reports/plans.json: the best plan and prediction for each setting of
plan_settings.py, with the FlexGen-like and DeepSpeed-like baselines beside it.

    PYTHONPATH=. python bench/make_plans_report.py
"""

from __future__ import annotations

from pathlib import Path

from plan_settings import MACHINES, workloads

from hrm.arch import resolve_model
from hrm.errors import HrmError
from hrm.hardware import resolve_hardware
from hrm.io import atomic_write_json, atomic_write_text
from planner.baselines import baselines
from planner.cost import Setting
from planner.search import search

REPORTS = Path(__file__).resolve().parent.parent / "reports"


def run_all() -> list[dict]:
    rows = []
    for model, machine in MACHINES:
        arch, hw = resolve_model(model), resolve_hardware(machine)
        dtype = hw.half_dtype
        for named in workloads():
            row = {"model": model, "hardware": machine, "workload": named.name, "dtype": dtype}
            try:
                result = search(
                    arch, hw, named.workload, weight_dtype=dtype, kv_dtype=dtype, top_k=3
                )
            except HrmError as exc:
                rows.append({**row, "error": str(exc)})
                continue
            setting = Setting(
                arch=arch, hardware=hw, workload=named.workload, weight_dtype=dtype, kv_dtype=dtype
            )
            rows.append(
                {
                    **row,
                    "plan": result.best.to_dict(),
                    "busy_fraction": result.best.busy_fraction,
                    "baselines": [b.to_dict() for b in baselines(setting)],
                }
            )
            print(
                f"{model:>14} {machine:>5} {named.name:<20} "
                f"{result.best.predicted.throughput_tok_s:9.1f} tok/s"
            )
    return rows


def _tput(entry) -> float | None:
    return entry["predicted"]["throughput_tok_s"] if entry and entry.get("predicted") else None


def _device(on_gpu: bool) -> str:
    return "GPU" if on_gpu else "CPU"


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Best plans: predicted throughput (hrm plan)",
        "",
        "Made by `bench/make_plans_report.py` (data: `reports/plans.json`). Datasheet profiles "
        "(`hardware_profiles/`), 16-bit weights and KV cache (float16 on T4s), schedule cgopipe, "
        "the search of `planner/search.py`. Throughput = generated tokens / (prefill + decode) of "
        "one batch. Baselines are policies chosen by those systems' own rules and evaluated with "
        "the same model (schedule gpu-attention): upper bounds on what their implementations "
        "reach, since the model charges no framework overhead. (p) = prompts padded to 418.",
        "",
        "N = batch, mu = micro-batch, attn/ffn = device, w = weights on GPU, kv = KV cache on GPU.",
        "",
        "| model | hardware | workload | N | mu | attn | ffn | w | kv | tok/s | prefill s | "
        "decode s | binds | FlexGen-like | DeepSpeed-like |",
        "|---|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['hardware']} | {r['workload']} |"
        if "error" in r:
            lines.append(f"{head} {r['error']} |" + " |" * 11)
            continue
        plan, p = r["plan"], r["plan"]["policy"]
        best = plan["predicted"]["throughput_tok_s"]
        base = {b["name"]: _tput(b) for b in r["baselines"]}

        def vs(name: str, base=base, best=best) -> str:
            value = base.get(name)
            return "does not fit" if value is None else f"{value:.1f} ({best / value:.1f}x)"

        lines.append(
            f"{head} {p['batch_size']} | {p['micro_batch_size']} | "
            f"{_device(p['attention_on_gpu'])} | {_device(p['ffn_on_gpu'])} | "
            f"{p['weights_gpu_fraction']:.0%} | {p['kv_gpu_fraction']:.0%} | {best:.1f} | "
            f"{plan['predicted']['prefill_s']:.0f} | {plan['predicted']['decode_s']:.0f} | "
            f"{plan['bottleneck']} | {vs('flexgen-like')} | {vs('deepspeed-like')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    rows = run_all()
    atomic_write_json(REPORTS / "plans.json", rows)
    atomic_write_text(REPORTS / "plans.md", markdown(rows))
    print(f"wrote {REPORTS / 'plans.md'} and plans.json")


if __name__ == "__main__":
    main()
