"""reports/plans.md's disk-tier table: plans for models larger than the host's memory, with the
share of the weights read from disk each pass and what binds (bench/make_plans_report.py)."""

from __future__ import annotations

from plan_settings import DISK_PLANS

from hrm.arch import resolve_model
from hrm.hardware import resolve_hardware
from hrm.units import format_bytes
from hrm.workload import Workload
from planner.search import NoPolicyFits, search

# MTBench-like, 128 new tokens (make_plans_report.MTBENCH_G128)
WORKLOAD = Workload(prompt_len_mean=77, prompt_len_max=418, gen_len=128)


def disk_rows() -> list[dict]:
    rows = []
    for model, machine, gpus, dtype, host in DISK_PLANS:
        hw = resolve_hardware(machine).with_gpu_count(gpus)
        if host is not None:
            hw = hw.with_resources(cpu_memory_bytes=host)
        arch = resolve_model(model)
        kv = hw.compute_dtype(dtype)
        row = {"model": model, "machine": machine, "gpus": gpus, "dtype": dtype,
               "host_bytes": hw.cpu.memory_bytes, "disk": hw.disk.read_bytes_per_s}  # fmt: skip
        try:
            search(arch, hw, WORKLOAD, weight_dtype=dtype, kv_dtype=kv, disk_tier="off")
            row["without_disk"] = "fits"
        except NoPolicyFits as exc:
            row["without_disk"] = str(exc)
        plan = search(arch, hw, WORKLOAD, weight_dtype=dtype, kv_dtype=kv, top_k=1).best
        row["plan"] = plan.to_dict()
        rows.append(row)
    return rows


def disk_markdown(rows: list[dict]) -> str:
    lines = [
        "",
        "## The disk tier: models larger than the host",
        "",
        "MTBench-like, 128 new tokens (`hrm plan --model M --hardware H [--gpus G] [--cpu-mem C] "
        "--dtype D`, `--disk-tier auto`): where no policy fits the host's memory, the search "
        "keeps the least share of the weights on disk that fits, read once a pass (every layer "
        "of a decode step) in 8 MiB reads at the profile's datasheet NVMe rate (one Samsung "
        "PM9A3, 6.5 GB/s), overlapped with the GPU, the CPU and the link. The disk keeps only "
        "weights the GPU streams (r_w + r_d <= F_g), as the executor's disk tier reads them.",
        "",
        "| model | machine | host | weights | N | mu | w GPU | w disk | disk per pass | "
        "per token | disk busy | tok/s | binds |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        p, pol = r["plan"], r["plan"]["policy"]
        disk = sum(p["memory"].get("disk", {}).values())
        total = p["predicted"]["prefill_s"] + p["predicted"]["decode_s"]
        tput = p["predicted"]["generated_tokens"] / total
        busy = p["busy_s"].get("disk", 0.0) / total
        machine = f"{r['gpus']}x {r['machine']}"
        lines.append(
            f"| {r['model']} | {machine} | {format_bytes(r['host_bytes'])} | {r['dtype']} | "
            f"{pol['batch_size']} | {pol['micro_batch_size']} | "
            f"{pol['weights_gpu_fraction']:.0%} | {pol.get('weights_disk_fraction', 0):.0%} | "
            f"{format_bytes(disk)} | {format_bytes(disk / pol['batch_size'])} | {busy:.0%} | "
            f"{tput:.1f} | {p['bottleneck']} |"
        )
    lines += ["", "Without the disk tier (`--disk-tier off`):", ""]
    lines += [f"- {r['model']} on {r['gpus']}x {r['machine']}, {r['dtype']}: {r['without_disk']}"
              for r in rows]  # fmt: skip
    return "\n".join(lines) + "\n"
