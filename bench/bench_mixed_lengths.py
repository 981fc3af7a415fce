"""Requests with their own max_tokens against the same requests padded to the largest: measured
and predicted, resident and under a paging plan on the CPU standing in for a GPU.

The bench model (Mixtral's layout at hidden 1024, width 3584, 4 layers, 8 experts top-2, random
weights in bfloat16); 64 requests of 32-token prompts, max_tokens drawn (seeded) from 4, 8, 16,
32 and 64, or all 64 ("padded"). A request that has its tokens leaves its micro-batch; a batch
ends with its longest. Each round runs every (case, run) once, in turn, so that the host's drift
falls on all alike; the median of the rounds is kept (prefill + decode, not the load or probe).
The prediction is `hrm run --hardware`'s: the planner's for the batches that ran, on this host's
bundled profile. Prints a table and writes reports/bench_mixed_lengths.json.
    python bench/bench_mixed_lengths.py [--rounds 3] [--profile ci-cpu-avx512]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BENCH = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, vocab_size=32000)  # fmt: skip
LENGTHS = (4, 8, 16, 32, 64)
RUNS = {"resident": None, "cgopipe": "N=64,mu=16,w=0,kv=0,attn=cpu,ffn=gpu"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--profile", default="ci-cpu-avx512", help="this host's CPU-only profile")
    p.add_argument("-o", "--output", default=str(ROOT / "reports" / "bench_mixed_lengths.json"))
    args = p.parse_args()

    import torch

    from executor.api import RunSpec
    from executor.checkpoint import random_checkpoint
    from executor.run import execute
    from hrm.arch import resolve_model
    from hrm.cli.records import run_record
    from hrm.hardware import resolve_hardware
    from hrm.hardware.stand_in import stand_in_profile
    from hrm.policy import Policy, parse_policy_text
    from hrm.requests import Request

    arch = dataclasses.replace(resolve_model("mixtral-8x7b"), name="bench", num_layers=4, **BENCH)
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (args.requests, args.prompt_len), generator=g).tolist()
    mixed = [rng.choice(LENGTHS) for _ in ids]
    cases = {"mixed": mixed, "padded": [max(LENGTHS)] * len(ids)}
    specs = {
        case: RunSpec(checkpoint=None, arch=arch, prompts=tuple(map(tuple, ids)),
                      gen_len=max(LENGTHS), dtype="bfloat16", device="cpu",
                      requests=tuple(Request(line=n + 1, prompt=p, max_tokens=m)
                                     for n, (p, m) in enumerate(zip(ids, lens, strict=True))))
        for case, lens in cases.items()
    }  # fmt: skip
    host = resolve_hardware(args.profile)
    policies = {
        run: Policy.resident(len(ids), "bfloat16", False)
        if text is None
        else parse_policy_text(text, weight_dtype="bfloat16", kv_dtype="bfloat16")
        for run, text in RUNS.items()
    }
    profiles = {"resident": host, "cgopipe": stand_in_profile(host, 8e9)}
    checkpoint = random_checkpoint(arch, "bfloat16")
    measured: dict[tuple[str, str], list[float]] = {}
    records = {}
    for _ in range(args.rounds + 1):  # the first round warms up and is not kept
        for run in RUNS:
            for case, spec in specs.items():
                schedule = "serial" if run == "resident" else run
                result = execute(spec, policies[run], schedule, checkpoint=checkpoint, quiet=True)
                m = result.measured
                measured.setdefault((run, case), []).append(m.prefill_s + m.decode_s)
                records[(run, case)] = run_record(
                    spec, result, policy=policies[run], schedule=schedule, profile=profiles[run]
                )
    return _report(args, cases, measured, records)


def _report(args, cases, measured, records) -> int:
    rows = []
    print(f"{'run':9} {'case':7} {'tokens':>6} {'measured s':>10} {'tok/s':>7} "
          f"{'predicted s':>11} {'tok/s':>7} {'error':>6}")  # fmt: skip
    for (run, case), runs in measured.items():
        record = records[(run, case)]
        seconds = statistics.median(runs[1:])
        tokens = record.measured.generated_tokens
        predicted = record.predicted
        predicted_s = predicted["prefill_s"] + predicted["decode_s"]
        error = (predicted["throughput_tok_s"] - tokens / seconds) / (tokens / seconds)
        rows.append({"run": run, "case": case, "max_tokens": cases[case], "tokens": tokens,
                     "measured_s": seconds, "runs_s": runs[1:], "measured_tok_s": tokens / seconds,
                     "predicted_s": predicted_s, "predicted_tokens": predicted["generated_tokens"],
                     "predicted_tok_s": predicted["throughput_tok_s"], "error": error})  # fmt: skip
        rate = predicted["throughput_tok_s"]
        print(f"{run:9} {case:7} {tokens:>6} {seconds:>10.2f} {tokens / seconds:>7.1f} "
              f"{predicted_s:>11.2f} {rate:>7.1f} {error:>+6.0%}")  # fmt: skip
    out = {"rounds": args.rounds, "requests": args.requests, "prompt_len": args.prompt_len,
           "profile": args.profile, "rows": rows}  # fmt: skip
    Path(args.output).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
