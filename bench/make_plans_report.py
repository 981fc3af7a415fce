"""Write reports/plans.md and reports/plans.json: the best plan and prediction for each setting of
plan_settings.py, with the FlexGen-like and DeepSpeed-like baselines beside it.

    PYTHONPATH=. python bench/make_plans_report.py [--batching-only | --disk-only]
"""

from __future__ import annotations

from pathlib import Path

from plan_settings import (
    EIGHT_GPUS,
    EXAMPLE_PRICES,
    FAMILIES,
    HOST_MEMORY,
    MACHINES,
    SCALING_GPUS,
    SCALING_MACHINE,
    SCALING_MODELS,
    workloads,
)

from hrm.arch import resolve_model
from hrm.errors import HrmError
from hrm.hardware import resolve_hardware
from hrm.io import atomic_write_json, atomic_write_text
from hrm.workload import Workload
from planner.baselines import baselines
from planner.compare import plan_options
from planner.search import search
from planner.setting import Setting

# MTBench-like, 128 new tokens: the workload of the scaling and cost tables
MTBENCH_G128 = Workload(prompt_len_mean=77, prompt_len_max=418, gen_len=128)

REPORTS = Path(__file__).resolve().parent.parent / "reports"


def run_all() -> list[dict]:
    rows = []
    settings = [(m, n, None) for m, n in MACHINES] + list(FAMILIES)
    for model, name, weights in settings:
        arch, hw = resolve_model(model), resolve_hardware(name)
        machine = name
        if (model, name) in HOST_MEMORY:
            hw = hw.with_resources(cpu_memory_bytes=HOST_MEMORY[(model, name)])
            machine = f"{name} ({HOST_MEMORY[(model, name)] / 1e9:.0f} GB host)"
        dtype = hw.half_dtype
        weights = weights or dtype
        if weights != dtype:
            machine = f"{machine}, {weights} weights"
        for named in workloads():
            row = {"model": model, "hardware": machine, "workload": named.name, "dtype": weights}
            try:
                result = search(
                    arch, hw, named.workload, weight_dtype=weights, kv_dtype=dtype, top_k=3
                )
            except HrmError as exc:
                rows.append({**row, "error": str(exc)})
                continue
            setting = Setting(
                arch=arch, hardware=hw, workload=named.workload, weight_dtype=weights,
                kv_dtype=dtype,
            )  # fmt: skip
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


def scaling_rows() -> list[dict]:
    """Each SCALING_MODELS on SCALING_MACHINE with 1, 2 and 4 of its GPUs (tensor parallel)."""
    hw = resolve_hardware(SCALING_MACHINE)
    rows = []
    for model in SCALING_MODELS:
        options = plan_options(
            resolve_model(model), {SCALING_MACHINE: hw}, MTBENCH_G128, gpu_counts=SCALING_GPUS
        )
        rows += [{"model": model, **o.to_dict()} for o in options]
    return rows


def eight_gpu_rows() -> list[dict]:
    """EIGHT_GPUS: the best plan on 8 GPUs of each machine, or which memory is short."""
    rows = []
    for model, machine, dtype in EIGHT_GPUS:
        (option,) = plan_options(
            resolve_model(model), {machine: resolve_hardware(machine)}, MTBENCH_G128,
            gpu_counts=(8,), dtype=dtype,
        )  # fmt: skip
        rows.append({"model": model, "dtype": dtype, **option.to_dict()})
    return rows


def eight_gpu_markdown(rows: list[dict]) -> str:
    lines = [
        "",
        "## DeepSeek-V3 on 8 GPUs",
        "",
        "MTBench-like, 128 new tokens (`hrm plan --model deepseek-v3 --hardware H --gpus 8 "
        "--dtype D`): 8 of the machine's GPU in tensor parallel, each with its own PCIe link (a "
        "what-if of its one-GPU profile), the host the profile's. Latent attention caches 576 "
        "values a token and layer, whole on every GPU. Where no policy fits, the planner's "
        "message says which memory is short and by how much.",
        "",
        "| machine | weights | N | mu | attn | w | tok/s | binds |",
        "|---|---|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        head = f"| 8x {r['machine']} | {r['dtype']} |"
        if r["plan"] is None:
            lines.append(f"{head} {r['why_not']} |" + " |" * 5)
            continue
        p = r["plan"]["policy"]
        lines.append(
            f"{head} {p['batch_size']} | {p['micro_batch_size']} | "
            f"{_device(p['attention_on_gpu'])} | {p['weights_gpu_fraction']:.0%} | "
            f"{r['throughput_tok_s']:.1f} | {r['plan']['bottleneck']} |"
        )
    return "\n".join(lines) + "\n"


def cost_rows() -> list[dict]:
    """Mixtral 8x7B on each single-GPU machine of EXAMPLE_PRICES, priced."""
    machines = {name: resolve_hardware(name) for name in EXAMPLE_PRICES}
    options = plan_options(
        resolve_model("mixtral-8x7b"), machines, MTBENCH_G128, prices=EXAMPLE_PRICES
    )
    return [o.to_dict(dataset_tokens=1e9) for o in options]


def _device(on_gpu: bool) -> str:
    return "GPU" if on_gpu else "CPU"


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Best plans: predicted throughput (hrm plan)",
        "",
        "Made by `bench/make_plans_report.py` (data: `reports/plans.json`). Datasheet profiles "
        "(`hardware_profiles/`), 16-bit weights (unless the hardware column names another format) "
        "and KV cache (float16 on T4s), schedule cgopipe, "
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


def scaling_markdown(rows: list[dict]) -> str:
    lines = [
        "",
        f"## Tensor parallelism: {SCALING_MACHINE} with 1, 2 and 4 of its GPUs",
        "",
        "MTBench-like, 128 new tokens (`hrm plan --hardware 4xt4 --gpus 1,2,4`). Each GPU adds "
        "its memory, bandwidth, FLOP/s and its own PCIe link; the layers pay two ring "
        "all-reduces per micro-batch over PCIe peer to peer (no NVLink on T4). Scaling is "
        "against the smallest GPU count that fits.",
        "",
        "| model | GPUs | N | mu | w | tok/s | scaling | all-reduce share of GPU time | binds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    first: dict[str, float] = {}
    for r in sorted(rows, key=lambda r: (r["model"], r["gpus"])):
        head = f"| {r['model']} | {r['gpus']} |"
        if r["plan"] is None:
            lines.append(f"{head} does not fit |" + " |" * 6)
            continue
        p = r["plan"]["policy"]
        base = first.setdefault(r["model"], r["throughput_tok_s"])
        lines.append(
            f"{head} {p['batch_size']} | {p['micro_batch_size']} | "
            f"{p['weights_gpu_fraction']:.0%} | {r['throughput_tok_s']:.1f} | "
            f"{r['throughput_tok_s'] / base:.2f}x | {r['all_reduce_share']:.1%} | "
            f"{r['plan']['bottleneck']} |"
        )
    return "\n".join(lines) + "\n"


def cost_markdown(rows: list[dict]) -> str:
    lines = [
        "",
        "## Cost per token: Mixtral 8x7B on one GPU of each bundled machine",
        "",
        "MTBench-like, 128 new tokens, `hrm plan --hardware t4,l4,a100-80g,h100-sxm,h200-sxm "
        "--price ...`. **The prices are examples** (round on-demand cloud rates for one such GPU "
        "and its host, USD per machine-hour), not quotes; the job is 1e9 generated tokens.",
        "",
        "| machine | example $/h | tok/s | $ per M tokens | job hours | job $ | binds |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["plan"] is None:
            lines.append(
                f"| {r['machine']} | {r['price_per_hour']:.2f} | does not fit |" + " |" * 4
            )
            continue
        lines.append(
            f"| {r['machine']} | {r['price_per_hour']:.2f} | {r['throughput_tok_s']:.1f} | "
            f"{r['cost_per_million_tokens']:.3f} | {r['dataset_seconds'] / 3600:.1f} | "
            f"{r['dataset_cost']:.0f} | {r['plan']['bottleneck']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    """Every table; with --batching-only the batching table alone is made again, with
    --disk-only the 8-GPU and disk-tier tables, the others written from reports/plans.json."""
    import json
    import sys

    from batching_rows import batching_markdown, batching_rows
    from disk_rows import disk_markdown, disk_rows

    if "--batching-only" in sys.argv[1:] or "--disk-only" in sys.argv[1:]:
        data = json.loads((REPORTS / "plans.json").read_text())
    else:
        data = {"plans": run_all(), "scaling": scaling_rows(), "cost": cost_rows()}
    if "--batching-only" not in sys.argv[1:]:
        data["eight_gpus"], data["disk"] = eight_gpu_rows(), disk_rows()
    if "--disk-only" not in sys.argv[1:]:
        data["batching"] = batching_rows()
    atomic_write_json(REPORTS / "plans.json", data)
    text = markdown(data["plans"]) + scaling_markdown(data["scaling"])
    text += eight_gpu_markdown(data["eight_gpus"]) + cost_markdown(data["cost"])
    text += batching_markdown(data["batching"]) + disk_markdown(data["disk"])
    atomic_write_text(REPORTS / "plans.md", text)
    print(f"wrote {REPORTS / 'plans.md'} and plans.json")


if __name__ == "__main__":
    main()
