"""Static against continuous batching of one job, on a paging plan with the CPU standing in for
the GPU (every pass streams the layers' pages, as a GPU run does over PCIe).

The job: --requests requests, prompts of 16-256 tokens and max_tokens of 8-128, drawn with a
fixed seed, on the bench model (Mixtral's layout at hidden 512, width 1792, 4 layers, 8 experts
top-2, random weights). The plan: N=64, mu=16, nothing resident, attention on the CPU, cgopipe.
Static runs batches of N to their longest answer; continuous keeps N running, admitting prompts
into every pass (at most one micro-batch of the longest prompt beside N decodes). Each round
runs both, in turn, so that the host's drift falls on both alike; the median of --rounds rounds
is kept, after one warm-up round. Then one bf16 round of each, after a warm-up round of its
own (a first bf16 run creates oneDNN's kernels for its GEMM shapes: 2.5-3.8x a warm prefill).
Each run is also predicted as `hrm run --hardware` predicts it, on this host's bundled profile
with its CPU standing in for the GPU (static: batch by batch; continuous: pass by pass), or on
--hardware (a profile of this host from `hrm profile`). Prints a table and writes
reports/bench_batching.json.
    python bench/bench_batching.py [--rounds 3] [--requests 256] [--hardware me.yaml]
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

BENCH = dict(hidden_size=512, intermediate_size=1792, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, vocab_size=32000, num_layers=4)  # fmt: skip
POLICY = "N=64,mu=16,w=0,kv=0,attn=cpu,ffn=gpu"
MODES = ("static", "continuous")


def job(requests: int, vocab: int, seed: int = 0):
    """(prompts, max_tokens) of the job, drawn with `seed`."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 256))] for _ in range(requests)]
    return prompts, [rng.randint(8, 128) for _ in prompts]


def run_once(spec, policy, checkpoint, mode: str, profile) -> dict:
    """One run of the job, measured and predicted (`hrm run --hardware`'s prediction on
    `profile`, this host's CPU standing in for the GPU)."""
    from executor.run import execute
    from hrm.cli.records import run_record

    result = execute(spec, policy, "cgopipe", checkpoint=checkpoint, quiet=True, batching=mode)
    record = run_record(spec, result, policy=policy, schedule="cgopipe", profile=profile)
    predicted = record.predicted or {}
    m, env = result.measured, result.environment
    seconds = m.prefill_s + m.decode_s
    kv = m.buffer_bytes["cpu"].get("kv cache", 0.0)
    stats = env.get("continuous") or {}
    return {
        "seconds": seconds,
        "tokens": m.generated_tokens,
        "tok_s": m.generated_tokens / seconds,
        "passes": stats.get("passes"),  # static: none counted
        "mean_sequences_per_pass": stats.get("mean_sequences_per_pass"),
        # continuous: the blocks held at the peak; static: each batch's rectangular cache
        "peak_kv_bytes": stats.get("peak_kv_bytes", kv),
        "kv_allocated_bytes": kv,
        "predicted_tok_s": predicted.get("throughput_tok_s"),
        "predicted_passes": predicted.get("passes"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--hardware", help="this host's profile to predict on (default: the bundled "
                   "profile of its kind)")  # fmt: skip
    p.add_argument("-o", "--output", default=str(ROOT / "reports" / "bench_batching.json"))
    args = p.parse_args()

    from executor.api import RunSpec
    from executor.checkpoint import random_checkpoint
    from hrm.arch import resolve_model
    from hrm.errors import HrmError
    from hrm.hardware import resolve_hardware
    from hrm.hardware.stand_in import stand_in_profile
    from hrm.policy import parse_policy_text
    from hrm.profiling.host_gemm import bundled_profile_of_this_host
    from hrm.requests import Request

    try:
        host = resolve_hardware(args.hardware) if args.hardware else bundled_profile_of_this_host()
    except HrmError as exc:
        print(f"bench_batching: --hardware: {exc}", file=sys.stderr)
        return 2
    profile = stand_in_profile(host, 8e9) if host is not None else None
    arch = dataclasses.replace(resolve_model("mixtral-8x7b"), name="bench", **BENCH)
    prompts, max_tokens = job(args.requests, arch.vocab_size)
    rows = {}
    out = {"requests": args.requests, "policy": POLICY, "rounds": args.rounds,
           "profile": host.name if host else None}  # fmt: skip
    for dtype, rounds in (("float32", args.rounds), ("bfloat16", 1)):
        requests = tuple(
            Request(line=n + 1, prompt=q, max_tokens=m)
            for n, (q, m) in enumerate(zip(prompts, max_tokens, strict=True))
        )
        spec = RunSpec(checkpoint=None, arch=arch, prompts=tuple(map(tuple, prompts)),
                       gen_len=max(max_tokens), dtype=dtype, device="cpu",
                       requests=requests)  # fmt: skip
        policy = parse_policy_text(POLICY, weight_dtype=dtype, kv_dtype=dtype)
        checkpoint = random_checkpoint(arch, dtype)
        runs = {mode: [] for mode in MODES}
        for r in range(rounds + 1):  # the first round warms up
            for mode in MODES:
                once = run_once(spec, policy, checkpoint, mode, profile)
                print(f"{dtype} round {r} {mode}: {once['tok_s']:.1f} tok/s", file=sys.stderr)
                runs[mode].append(once)
        kept = {m: v[1:] for m, v in runs.items()}
        rows[dtype] = {m: _median(v) for m, v in kept.items()}
    _print(rows)
    ratio = rows["float32"]["continuous"]["tok_s"] / rows["float32"]["static"]["tok_s"]
    out |= {"rows": rows, "continuous_over_static": ratio}
    Path(args.output).write_text(json.dumps(out, indent=2))
    print(f"continuous / static (float32, median of {args.rounds}): {ratio:.2f}x")
    print(f"wrote {args.output}")
    return 0


def _median(runs: list[dict]) -> dict:
    """The run of median seconds, with every round's tokens/s beside it."""
    ranked = sorted(runs, key=lambda r: r["seconds"])
    rates = [r["tok_s"] for r in runs]
    return ranked[len(ranked) // 2] | {
        "rounds_tok_s": rates,
        "median_tok_s": statistics.median(rates),
    }


def _print(rows) -> None:
    print(f"{'dtype':9} {'batching':10} {'tokens':>6} {'seconds':>8} {'tok/s':>7} {'passes':>6} "
          f"{'seq/pass':>8} {'peak KV MB':>10} {'predicted':>9} {'error':>6}")  # fmt: skip
    for dtype, modes in rows.items():
        for mode, r in modes.items():
            seq = r["mean_sequences_per_pass"]
            print(f"{dtype:9} {mode:10} {r['tokens']:>6} {r['seconds']:>8.2f} {r['tok_s']:>7.1f} "
                  f"{r['passes'] or '-':>6} {seq if seq is None else round(seq, 1)!s:>8} "
                  f"{r['peak_kv_bytes'] / 1e6:>10.1f} {_predicted(r)}")  # fmt: skip


def _predicted(r: dict) -> str:
    """The predicted tok/s and its error against the measured, or '-' without a profile."""
    if not r.get("predicted_tok_s"):
        return f"{'-':>9} {'-':>6}"
    error = (r["predicted_tok_s"] - r["tok_s"]) / r["tok_s"]
    return f"{r['predicted_tok_s']:>9.1f} {error:>+6.0%}"


if __name__ == "__main__":
    raise SystemExit(main())
