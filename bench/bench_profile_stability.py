"""Do two `hrm profile --quick` runs agree? Bandwidth and peak FLOP/s must be within 15 %.

Runs the real command twice (CPU only), prints a table of each run's figures and their relative
spread |a - b| / min(a, b), writes reports/profile_stability.json, and exits 1 when a gated
figure (the stored memory bandwidth, the peak FLOP/s of each dtype) disagrees by more than 15 %.
Copy and triad bandwidth are shown for information. Run on a quiet machine: the load average
before and after is recorded, since another process on the cores halves what they measure.

    PYTHONPATH=. python bench/bench_profile_stability.py
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hrm import units
from hrm.hardware import HardwareProfile
from hrm.io import atomic_write_json

THRESHOLD = 0.15
REPORT = Path(__file__).resolve().parent.parent / "reports" / "profile_stability.json"


def quick_run(path: Path) -> tuple[HardwareProfile, float]:
    """One `hrm profile --quick` in a fresh process; returns the profile and its wall time."""
    command = [sys.executable, "-m", "hrm", "profile", "--quick", "--device", "cpu", "--quiet"]
    started = time.perf_counter()
    subprocess.run([*command, "-o", str(path)], check=True, stdout=subprocess.DEVNULL)
    return HardwareProfile.load(path), time.perf_counter() - started


def figures(profile: HardwareProfile) -> dict[str, tuple[float, bool]]:
    """{name: (value, gated)}: the figures this benchmark compares between runs."""
    cpu = profile.cpu
    out = {"memory bandwidth (read)": (cpu.memory_bandwidth_bytes_per_s, True)}
    for kind in ("copy", "triad"):
        median = profile.provenance["cpu_memory_bandwidth"][kind]["median"]
        out[f"{kind} bandwidth"] = (units.parse_bandwidth(median), False)
    for dtype, rate in cpu.peak_flops_per_s.items():
        out[f"peak {dtype}"] = (rate, True)
    return out


def main() -> int:
    REPORT.parent.mkdir(exist_ok=True)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [quick_run(Path(tmp) / f"run{i}.yaml") for i in (1, 2)]
    load_after = os.getloadavg()
    (first, first_s), (second, second_s) = runs
    a, b = figures(first), figures(second)
    rows, failures = [], []
    print(f"{'figure':26} {'run 1':>16} {'run 2':>16} {'spread':>8}")
    for name in [n for n in a if n in b]:  # a dtype measured in one run only is not compared
        (x, gated), (y, _) = a[name], b[name]
        spread = abs(x - y) / min(x, y)
        fmt = units.format_bandwidth if "bandwidth" in name else units.format_flops
        flag = "" if not gated else (" FAIL" if spread > THRESHOLD else "")
        print(f"{name:26} {fmt(x):>16} {fmt(y):>16} {spread:>7.1%}{flag}")
        rows.append(
            {"figure": name, "run1": x, "run2": y, "relative_spread": spread, "gated": gated}
        )
        if gated and spread > THRESHOLD:
            failures.append(name)
    busy = [run.provenance["other_processes_cpu_share"] for run, _ in runs]
    print(f"wall time: run 1 {first_s:.1f} s, run 2 {second_s:.1f} s")
    print(f"other processes' share of CPU time while measuring: run 1 {busy[0]}, run 2 {busy[1]}")
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    atomic_write_json(
        REPORT,
        {
            "what": "two `hrm profile --quick --device cpu` runs; spread = |a - b| / min(a, b)",
            "host": platform.node(),
            "cpu_model": first.cpu.name,
            "cores": first.cpu.cores,
            "date": first.provenance["date"],
            "threshold": THRESHOLD,
            "load_average_before": list(load_before),
            "load_average_after": list(load_after),
            "wall_s": [first_s, second_s],
            "other_processes_cpu_share": busy,
            "figures": rows,
            "passed": not failures,
        },
    )
    print(f"wrote {REPORT}")
    if failures:
        print(f"disagree by more than {THRESHOLD:.0%}: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
