"""The disk tier on this host: a paging plan with half of the streamed weights read from disk
each pass, against the same plan with them in host memory, measured and predicted.

The CPU stands in for the GPU (hrm/hardware/stand_in.py), on this host's bundled profile with
the disk under --disk-dir measured first (`hrm profile --disk`'s O_DIRECT read curve). The model:
Mixtral's layout at hidden 1024, expert width 3584, 4 layers, 8 experts top-2, random weights
(the peer bench's shape). The plan: N=16, mu=16, nothing resident, attention on the CPU,
cgopipe, static batches; r_d = 0 and 0.5. The disk tier's reads are O_DIRECT (the page cache
never serves them), 8 MiB-aligned whole layers' parts. Each round runs both, in turn; the median
of --rounds rounds after a warm-up. Prints a table and writes reports/bench_disk_tier.json.
    python bench/bench_disk_tier.py [--rounds 3] [--disk-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BENCH = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8,
             num_key_value_heads=2, head_dim=128, vocab_size=32000, num_layers=4)  # fmt: skip
POLICY = "N=16,mu=16,w=0,kv=0,attn=cpu,ffn=gpu"
SHARES = (0.0, 0.5)


def run_once(spec, policy, checkpoint, profile, disk_dir: str) -> dict:
    from executor.run import execute
    from hrm.cli.records import run_record

    result = execute(spec, policy, "cgopipe", checkpoint=checkpoint, quiet=True,
                     batching="static", disk=(disk_dir, True))  # fmt: skip
    record = run_record(spec, result, policy=policy, schedule="cgopipe", profile=profile)
    m = result.measured
    seconds = m.prefill_s + m.decode_s
    return {"seconds": seconds, "tok_s": m.generated_tokens / seconds,
            "disk_bytes": m.link_bytes.get("disk", 0.0),
            "disk_busy": m.busy_fraction.get("disk", 0.0),
            "predicted_tok_s": (record.predicted or {}).get("throughput_tok_s")}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--disk-dir", default=tempfile.gettempdir())
    p.add_argument("-o", "--output", default=str(ROOT / "reports" / "bench_disk_tier.json"))
    args = p.parse_args()

    from executor.api import RunSpec
    from executor.checkpoint import random_checkpoint
    from hrm.arch import resolve_model
    from hrm.hardware.stand_in import stand_in_profile
    from hrm.policy import parse_policy_text
    from hrm.profiling.disk import measure_disk
    from hrm.profiling.host_gemm import bundled_profile_of_this_host

    disk = measure_disk(args.disk_dir)
    host = bundled_profile_of_this_host()
    profile = dataclasses.replace(stand_in_profile(host, 8e9), disk=disk)
    arch = dataclasses.replace(resolve_model("mixtral-8x7b"), name="bench", **BENCH)
    prompts = tuple(tuple(range(i, i + 64)) for i in range(16))
    spec = RunSpec(checkpoint=None, arch=arch, prompts=prompts, gen_len=16, dtype="bfloat16",
                   device="cpu")  # fmt: skip
    checkpoint = random_checkpoint(arch, "bfloat16")
    runs = {share: [] for share in SHARES}
    for r in range(args.rounds + 1):  # the first round warms up
        for share in SHARES:
            policy = parse_policy_text(f"{POLICY},disk={share}", weight_dtype="bfloat16",
                                       kv_dtype="bfloat16")  # fmt: skip
            once = run_once(spec, policy, checkpoint, profile, args.disk_dir)
            print(f"round {r} disk {share}: {once['tok_s']:.1f} tok/s", file=sys.stderr)
            if r:
                runs[share].append(once)
    rows = {str(share): _median(v) for share, v in runs.items()}
    read = [(x, y) for x, y in disk.read_curve.points]
    out = {"host": host.name, "disk_dir": disk.path, "read_curve": read, "policy": POLICY,
           "rounds": args.rounds, "rows": rows}  # fmt: skip
    print(f"disk {disk.path}: " + ", ".join(f"{x / 2**20:g} MiB {y / 1e9:.2f} GB/s"
                                            for x, y in read))  # fmt: skip
    print(f"{'r_d':>4} {'tok/s':>7} {'predicted':>9} {'error':>6} {'disk MB':>8} {'disk busy':>9}")
    for share, r in rows.items():
        error = r["predicted_tok_s"] / r["tok_s"] - 1
        print(f"{share:>4} {r['tok_s']:>7.1f} {r['predicted_tok_s']:>9.1f} {error:>+6.0%} "
              f"{r['disk_bytes'] / 1e6:>8.0f} {r['disk_busy']:>9.0%}")  # fmt: skip
    Path(args.output).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.output}")
    return 0


def _median(runs: list[dict]) -> dict:
    ranked = sorted(runs, key=lambda r: r["seconds"])
    rates = [r["tok_s"] for r in runs]
    return ranked[len(ranked) // 2] | {"rounds_tok_s": rates, "median": statistics.median(rates)}


if __name__ == "__main__":
    sys.exit(main())
