"""Wall time of the full `hrm plan` search for each setting of reports/plans.md (target < 1 s),
of `--gpus 1,2,4` for Mixtral 8x22B on 4xt4 (target < 3 s) and of a five-machine comparison
(target < 5 s).

    PYTHONPATH=. python bench/bench_planner.py [--repeats 3]

Prints a table and writes reports/bench_planner.json. The machine may be shared, so each setting
is timed `repeats` times and the median is kept (the minimum beside it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from plan_settings import EXAMPLE_PRICES, MACHINES, workloads

from hrm.arch import resolve_model
from hrm.hardware import resolve_hardware
from hrm.io import atomic_write_json
from hrm.workload import Workload
from planner.compare import plan_options
from planner.search import search

REPORTS = Path(__file__).resolve().parent.parent / "reports"
TARGET_S = 1.0
COMPARISON_TARGETS_S = {"gpus 1,2,4": 3.0, "five machines": 5.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    print(
        f"{'model':>14} {'hw':>5} {'workload':<20} {'median s':>9} {'min s':>7} "
        f"{'grid':>5} {'milps':>5}"
    )
    for model, machine in MACHINES:
        arch, hw = resolve_model(model), resolve_hardware(machine)
        for named in workloads():
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                result = search(
                    arch, hw, named.workload, weight_dtype=hw.half_dtype, kv_dtype=hw.half_dtype
                )
                times.append(time.perf_counter() - start)
            row = {
                "model": model,
                "hardware": machine,
                "workload": named.name,
                "median_s": statistics.median(times),
                "min_s": min(times),
                "grid_points": result.stats.grid_points,
                "milps_solved": result.stats.milps_solved,
            }
            rows.append(row)
            print(
                f"{model:>14} {machine:>5} {named.name:<20} {row['median_s']:9.3f} "
                f"{row['min_s']:7.3f} {row['grid_points']:>5} {row['milps_solved']:>5}"
            )
    medians = [r["median_s"] for r in rows]
    summary = {
        "settings": len(rows),
        "max_s": max(medians),
        "median_s": statistics.median(medians),
        "target_s": TARGET_S,
        "under_target": sum(m < TARGET_S for m in medians),
    }
    print(
        f"max {summary['max_s']:.3f} s, median {summary['median_s']:.3f} s, "
        f"{summary['under_target']}/{len(rows)} under {TARGET_S} s"
    )
    comparisons = time_comparisons(args.repeats)
    atomic_write_json(
        REPORTS / "bench_planner.json",
        {"summary": summary, "rows": rows, "comparisons": comparisons},
    )


def time_comparisons(repeats: int) -> list[dict]:
    """The capacity-planning searches of `hrm plan --gpus` and of a list of machines."""
    workload = Workload(prompt_len_mean=77, prompt_len_max=418, gen_len=128)
    jobs = {
        "gpus 1,2,4": lambda: plan_options(
            resolve_model("mixtral-8x22b"),
            {"4xt4": resolve_hardware("4xt4")},
            workload,
            gpu_counts=[1, 2, 4],
        ),
        "five machines": lambda: plan_options(
            resolve_model("mixtral-8x7b"),
            {name: resolve_hardware(name) for name in EXAMPLE_PRICES},
            workload,
            prices=EXAMPLE_PRICES,
        ),
    }
    out = []
    for name, job in jobs.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            job()
            times.append(time.perf_counter() - start)
        target = COMPARISON_TARGETS_S[name]
        row = {"comparison": name, "median_s": statistics.median(times), "target_s": target}
        out.append(row)
        print(f"{name:<16} median {row['median_s']:.3f} s (target {target} s)")
    return out


if __name__ == "__main__":
    main()
