"""What the engine's modes cost on a CPU: the same offloaded plans run inline, threaded and
deferred, on the CPU standing in for the GPU.

The bench model (Mixtral's layout at hidden 1024, width 3584, 4 layers, 8 experts top-2,
random weights in bfloat16), one fixed paging policy per schedule (N=32, mu=8, nothing
resident), planned for the H200 datasheet. Each round runs every (schedule, mode) once, in
turn, so that the host's drift falls on all of them alike; the median of the rounds is kept, of
the prefill and decode time (not the load or the GEMM path's probe).
Tokens must be equal across modes. Prints a table and writes reports/bench_engine_modes.json.
    python bench/bench_engine_modes.py [--rounds 3] [--gen-len 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("inline", "threads", "deferred")
SCHEDULES = ("cgopipe", "overlap", "gpu-attention")
BENCH = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, vocab_size=32000)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("-o", "--output", default=str(ROOT / "reports" / "bench_engine_modes.json"))
    args = p.parse_args()

    import torch

    from executor.api import RunSpec
    from executor.checkpoint import random_checkpoint
    from executor.run import execute
    from hrm.arch import resolve_model
    from hrm.cli.memory_check import available_host_bytes
    from hrm.hardware import resolve_hardware
    from hrm.policy import parse_policy_text
    from hrm.units import format_bytes
    from hrm.workload import Workload
    from planner import predict

    arch = dataclasses.replace(resolve_model("mixtral-8x7b"), name="bench", num_layers=4, **BENCH)
    workload = Workload(
        prompt_len_mean=args.prompt_len, prompt_len_max=args.prompt_len, gen_len=args.gen_len
    )
    g = torch.Generator().manual_seed(0)
    prompts = tuple(
        tuple(x) for x in torch.randint(0, arch.vocab_size, (32, args.prompt_len), generator=g)
    )
    spec = RunSpec(checkpoint=None, arch=arch, prompts=prompts, gen_len=args.gen_len,
                   dtype="bfloat16", device="cpu")  # fmt: skip
    plans = {}
    for schedule in SCHEDULES:
        attn = "gpu" if schedule == "gpu-attention" else "cpu"
        policy = parse_policy_text(
            f"N=32,mu=8,w=0,kv=0,attn={attn},ffn=gpu", weight_dtype="bfloat16", kv_dtype="bfloat16"
        )
        plans[schedule] = predict(arch, resolve_hardware("h200-sxm"), workload, policy, schedule)
    # the CPU stands in for the GPU: the host holds both sides of the largest plan
    need = max(plan.memory.cpu_bytes + plan.memory.gpu_bytes for plan in plans.values())
    if need > available_host_bytes():
        print(
            f"bench_engine_modes: the runs need {format_bytes(need, 3)} of host memory, this "
            f"host has {format_bytes(available_host_bytes(), 3)} available; give a smaller "
            "--prompt-len or --gen-len",
            file=sys.stderr,
        )
        return 2
    checkpoint = random_checkpoint(arch, "bfloat16")
    seconds: dict[tuple[str, str], list[float]] = {}
    tokens: dict[str, list] = {}
    for _ in range(args.rounds + 1):  # the first round warms up and is not kept
        for schedule in SCHEDULES:
            for mode in MODES:
                os.environ["HRM_ENGINE"] = mode
                plan = plans[schedule]
                run = execute(spec, plan.policy, schedule, checkpoint=checkpoint, quiet=True)
                timed = run.measured.prefill_s + run.measured.decode_s  # not load or probe
                seconds.setdefault((schedule, mode), []).append(timed)
                ids = [run.outputs[i]["output_token_ids"] for i in range(len(prompts))]
                assert tokens.setdefault(schedule, ids) == ids, f"{schedule} {mode}: other tokens"
    rows = []
    print(f"{'schedule':14} {'mode':9} {'median s':>9} {'vs inline':>9}")
    for schedule in SCHEDULES:
        base = statistics.median(seconds[(schedule, "inline")][1:])
        for mode in MODES:
            runs = seconds[(schedule, mode)][1:]
            median = statistics.median(runs)
            rows.append({"schedule": schedule, "mode": mode, "median_s": median,
                         "runs_s": runs, "vs_inline": median / base})  # fmt: skip
            print(f"{schedule:14} {mode:9} {median:>9.2f} {median / base:>8.2f}x")
    Path(args.output).write_text(json.dumps({"rounds": args.rounds, "rows": rows}, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
