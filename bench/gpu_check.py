"""The prepared check for a lent GPU: profile the machine, run every schedule with that profile at
one GPU budget (each plan warmed up once, then timed), and beside them what a user would pick
instead at the same budget: transformers with accelerate's offload (the device map that
`device_map="auto"` with `max_memory` makes). Prints one table and rewrites the JSON after each
row, so a row that fails costs only itself. bench/gpu_check.sh runs it; see there.
    python bench/gpu_check.py --out DIR [--layers 16] [--gpu-mem 16GB] [--profile FILE]
    python bench/gpu_check.py --out DIR --dry-run   (tiny model, the CPU standing in: CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_schedules import measure_plan, plan_all  # noqa: E402

from hrm.arch import ModelArch, resolve_model  # noqa: E402
from hrm.hardware import resolve_hardware  # noqa: E402
from hrm.plan import QUEUES, SCHEDULES  # noqa: E402
from hrm.units import parse_bytes  # noqa: E402
from hrm.workload import Workload  # noqa: E402

# The dry run's model: Mixtral's layout at a size a 2-core CI machine runs in seconds.
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, num_experts=4, vocab_size=512)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the profile, JSON and table")
    p.add_argument("--dry-run", action="store_true", help="tiny model, CPU standing in")
    p.add_argument("--profile", help="a measured profile to use instead of measuring one")
    p.add_argument("--name", default="h200-measured", help="name of the measured profile")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--gpu-mem", default="16GB")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--policy", help='run this policy under every schedule, e.g. "N=64,mu=16,w=0"')
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        args.layers, args.gpu_mem, args.max_batch = 3, "2.5MB", 8
        args.prompt_len, args.gen_len = 8, 3
        args.policy = args.policy or "N=8,mu=4,w=0,kv=0"  # the planner would keep it on the CPU
    arch = _arch(args)
    device = "cpu" if args.dry_run else "cuda"
    hardware, profile_note = _profile(args, out, device)
    print(profile_note, flush=True)
    report = {"device": device, "hardware": hardware.name, "profile": profile_note,
              "layers": args.layers, "dry_run": args.dry_run, "rows": []}  # fmt: skip
    budget = parse_bytes(args.gpu_mem, "--gpu-mem")
    workload = Workload(
        prompt_len_mean=args.prompt_len, prompt_len_max=args.prompt_len, gen_len=args.gen_len
    )
    plans = plan_all(arch, hardware, workload, [budget], args.max_batch, args.dtype, args.policy)
    rows = _run_schedules(args, arch, hardware, plans, budget, device, report, out, args.dtype)
    # cgopipe with int4 weights streamed compact and dequantized on the GPU (issue 34)
    compact = plan_all(arch, hardware, workload, [budget], args.max_batch, "int4", args.policy)
    _run_schedules(args, arch, hardware, compact, budget, device, report, out, "int4", ["cgopipe"])
    # cgopipe with half of the streamed weights read from disk each pass (issue 50)
    _run_schedules(args, arch, hardware, _on_disk(plans, budget), budget, device, report, out,
                   args.dtype, ["cgopipe"], suffix="disk")  # fmt: skip
    _run_batching(args, arch, hardware, plans[(budget, "cgopipe")], device, report, out)
    _run_baseline(args, arch, budget, device, rows, report, out)
    table = _table(report["rows"])
    print(table)
    (out / "table.txt").write_text(table + "\n")
    failed = [r for r in report["rows"] if "failed" in r]
    return 1 if failed else 0


def _arch(args) -> ModelArch:
    base = resolve_model("mixtral-8x7b")
    if args.dry_run:
        base = dataclasses.replace(base, name="tiny-mixtral", **TINY)
    return dataclasses.replace(base, num_layers=args.layers)


def _profile(args, out: Path, device: str):
    """The measured profile (hrm profile on this machine), or the one given; a dry run plans
    for the bundled H200 datasheet: a CPU's own profile has no GPU to plan for."""
    if args.profile:
        return resolve_hardware(args.profile), f"profile: {args.profile} (given)"
    if args.dry_run:
        return resolve_hardware("h200-sxm"), "profile: h200-sxm datasheet (dry run, no GPU)"
    path = out / f"{args.name}.yaml"
    cmd = [sys.executable, "-m", "hrm", "profile", "--quick", "--device", device, "--quiet",
           "-o", str(path), "--compare", "h200-sxm"]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    (out / "profile.txt").write_text(done.stdout + done.stderr)
    took = time.perf_counter() - t0
    if done.returncode != 0:
        note = f"profile: hrm profile failed ({took:.0f} s), planning for h200-sxm's datasheet"
        return resolve_hardware("h200-sxm"), note
    return resolve_hardware(str(path)), f"profile: measured here in {took:.0f} s ({path.name})"


def _save(report, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))


def _prompts(arch, n: int, length: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, arch.vocab_size, (n, length), generator=g).tolist()
    return tuple(tuple(x) for x in ids)


def _on_disk(plans, budget):
    """The cgopipe plan with half of what it streams kept on disk (the disk tier's file in the
    temp directory, read each pass); a plan that does not fit stays its reason."""
    plan = plans[(budget, "cgopipe")]
    if isinstance(plan, str) or not plan.policy.ffn_on_gpu:
        return {(budget, "cgopipe"): plan if isinstance(plan, str) else "the layers run on the CPU"}
    share = 0.5 * (1 - plan.policy.weights_gpu_fraction)
    policy = dataclasses.replace(plan.policy, weights_disk_fraction=share)
    return {(budget, "cgopipe"): dataclasses.replace(plan, policy=policy)}


def _run_schedules(
    args, arch, hardware, plans, budget, device_name, report, out, dtype, schedules=SCHEDULES,
    suffix="",
):  # fmt: skip
    """Each schedule: warm-up run, timed run; a failure is the row's, not the script's. Rows in
    a dtype other than --dtype are named with it, and with `suffix`."""
    import torch

    from executor.checkpoint import random_checkpoint

    device = torch.device(device_name)
    checkpoint = random_checkpoint(arch, hardware.compute_dtype(dtype))
    rows = {}
    for schedule in schedules:
        plan = plans[(budget, schedule)]
        name = schedule if dtype == args.dtype else f"{schedule} {dtype}"
        name = f"{name} {suffix}" if suffix else name
        row = {"schedule": name, "gpu_mem_bytes": budget, "dtype": dtype}
        report["rows"].append(row)
        if isinstance(plan, str):
            row["fits"] = False
            row["why"] = plan
            _save(report, out)
            continue
        row.update(fits=True, plan=plan.to_dict())
        prompts = _prompts(arch, plan.policy.batch_size, args.prompt_len)
        run = (plan, arch, checkpoint, prompts, args.gen_len, device, budget, hardware, dtype)
        try:
            measure_plan(*run)  # warm-up: allocator, kernels, page cache
            _, measured = measure_plan(*run)
            row.update(measured)
            rows[schedule] = row
        except Exception as exc:  # noqa: BLE001 (one row fails, the check goes on)
            row["failed"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc()
            print(f"{schedule}: failed: {row['failed']}", file=sys.stderr, flush=True)
        _save(report, out)
    del checkpoint
    return rows


def hf_config(arch: ModelArch):
    """transformers' MixtralConfig of the same geometry."""
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        num_local_experts=arch.num_experts,
        num_experts_per_tok=arch.experts_per_token,
        max_position_embeddings=4096,
        rope_parameters={"rope_theta": arch.rope_theta, "rope_type": "default"},
    )


def _run_baseline(args, arch, budget, device_name, rows, report, out) -> None:
    """transformers + accelerate at the same budget and the best plan's batch (halved until it
    fits), its own warm-up first."""
    row = {"schedule": "transformers+accelerate", "gpu_mem_bytes": budget}
    report["rows"].append(row)
    best = max(rows.values(), key=lambda r: r["measured"]["throughput_tok_s"], default=None)
    n = best["plan"]["policy"]["batch_size"] if best else 8
    try:
        model = _offloaded_model(arch, budget, device_name, args.dtype)
        while True:
            try:
                _generate(model, arch, n, args, device_name)  # warm-up
                seconds = _generate(model, arch, n, args, device_name)
                break
            except RuntimeError as exc:
                if "out of memory" not in str(exc).lower() or n == 1:
                    raise
                n //= 2
        row.update(
            batch_size=n,
            measured={"throughput_tok_s": n * args.gen_len / seconds, "total_s": seconds},
            peak_gpu_bytes=_peak_gpu(device_name),
        )
    except Exception as exc:  # noqa: BLE001
        row["failed"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc()
        print(f"baseline: failed: {row['failed']}", file=sys.stderr, flush=True)
    _save(report, out)


def _offloaded_model(arch, budget, device_name, dtype):
    import torch
    from accelerate import dispatch_model, infer_auto_device_map
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=getattr(torch, dtype)).eval()
    if device_name != "cuda":  # the dry run: everything stays on the CPU
        return model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    device_map = infer_auto_device_map(
        model,
        max_memory={0: int(budget * 0.8), "cpu": 10**15},  # a fifth left for KV, activations
        no_split_module_classes=model._no_split_modules,
    )
    return dispatch_model(model, device_map=device_map, main_device=0)


def _generate(model, arch, n: int, args, device_name: str) -> float:
    import torch

    ids = torch.tensor(_prompts(arch, n, args.prompt_len), device=device_name)
    if device_name == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=args.gen_len, min_new_tokens=args.gen_len,
                       do_sample=False, pad_token_id=0)  # fmt: skip
    if device_name == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _peak_gpu(device_name: str) -> float:
    import torch

    return float(torch.cuda.max_memory_allocated()) if device_name == "cuda" else 0.0


def _run_batching(args, arch, hardware, plan, device_name, report, out) -> None:
    """Static against continuous batching under the cgopipe plan, one job of 4 N requests with
    max_tokens of gen_len/4 to gen_len (seeded): a row each, measured in the same process; and
    the continuous plan of that job over the cgopipe plan's pool (hrm plan --batching
    continuous: more than N running), measured against its prediction."""
    import random

    from executor.api import RunSpec
    from executor.checkpoint import random_checkpoint
    from executor.run import execute
    from hrm.requests import Request

    if isinstance(plan, str):
        return
    rng = random.Random(0)
    prompts = _prompts(arch, 4 * plan.policy.batch_size, args.prompt_len)
    most = [rng.randint(max(1, args.gen_len // 4), args.gen_len) for _ in prompts]
    requests = tuple(
        Request(line=i + 1, prompt=list(q), max_tokens=m)
        for i, (q, m) in enumerate(zip(prompts, most, strict=True))
    )
    spec = RunSpec(checkpoint=None, arch=arch, prompts=prompts, gen_len=args.gen_len,
                   dtype=args.dtype, device=device_name, requests=requests)  # fmt: skip
    checkpoint = random_checkpoint(arch, hardware.compute_dtype(args.dtype))
    for mode in ("static", "continuous", "continuous planned"):
        row = {"schedule": f"cgopipe {mode}", "batching": mode, "batch_size":
               plan.policy.batch_size, "requests": len(prompts)}  # fmt: skip
        report["rows"].append(row)
        try:
            planned = "planned" in mode
            limits = _continuous_limits(arch, hardware, plan, spec, row) if planned else {}
            for _ in range(2):  # warm-up, then timed
                result = execute(spec, plan.policy, "cgopipe", checkpoint=checkpoint, quiet=True,
                                 batching=mode.split()[0], **limits)  # fmt: skip
            m = result.measured
            row["measured"] = {"throughput_tok_s": m.throughput_tok_s,
                               "generated_tokens": m.generated_tokens}  # fmt: skip
            row["passes"] = (result.environment.get("continuous") or {}).get("passes")
        except Exception as exc:  # noqa: BLE001 (one row fails, the check goes on)
            row["failed"] = f"{type(exc).__name__}: {exc}"
            row["traceback"] = traceback.format_exc()
        _save(report, out)


def _continuous_limits(arch, hardware, plan, spec, row) -> dict:
    """The continuous plan of `spec`'s job over `plan`'s pool, as `hrm run --hardware` plans a
    run's own requests (hrm/cli/plan_continuous.continuous_for_run): its limits for execute,
    its prediction and running count in `row`."""
    from hrm.cli.plan_continuous import continuous_for_run

    lengths = [(len(p), spec.max_new(i)) for i, p in enumerate(spec.prompts)]
    c = continuous_for_run(arch, hardware, spec.workload(), lengths, [plan])["plan"].continuous
    row["predicted_tok_s"], row["max_running"] = c.predicted.throughput_tok_s, c.max_running
    return {"max_running": c.max_running, "token_budget": c.token_budget}


def _table(rows) -> str:
    head = (f"{'schedule':24} {'N':>4} {'mu':>3} {'pred tok/s':>10} {'meas tok/s':>10} "
            f"{'err':>6} {'gpu':>4} {'cpu':>4} {'h2d':>4} {'d2h':>4} {'H2D GB/s':>8} "
            f"{'peak/plan GB':>13}")  # fmt: skip
    lines = [head]
    for r in rows:
        name = r["schedule"]
        if "failed" in r or not r.get("fits", True):
            lines.append(f"{name:24} {r.get('failed') or 'does not fit: ' + r.get('why', '')}")
            continue
        tput = r["measured"]["throughput_tok_s"]
        if "batching" in r:
            predicted = f"{r['predicted_tok_s']:>10.1f}" if "predicted_tok_s" in r else " " * 10
            running = f", up to {r['max_running']} running" if "max_running" in r else ""
            lines.append(f"{name:24} {r['batch_size']:>4} {'':>3} {predicted} {tput:>10.1f} "
                         f"({r['requests']} requests of mixed max_tokens, passes "
                         f"{r['passes'] or '-'}{running})")  # fmt: skip
            continue
        if "plan" not in r:  # the baseline
            lines.append(f"{name:24} {r['batch_size']:>4} {'':>3} {'':>10} {tput:>10.1f} "
                         f"{'':>6} {'':>24} {r['peak_gpu_bytes'] / 1e9:>6.1f} /   -")  # fmt: skip
            continue
        pol, busy = r["plan"]["policy"], r["measured"]["busy_fraction"]
        peak = r["measured"]["peak_memory_bytes"].get("gpu", 0.0) / 1e9
        planned = r["planned_gpu_bytes"] / 1e9
        lines.append(
            f"{name:24} {pol['batch_size']:>4} {pol['micro_batch_size']:>3} "
            f"{r['predicted']['throughput_tok_s']:>10.1f} {tput:>10.1f} "
            f"{100 * r['error']:>+5.0f}% "
            + " ".join(f"{busy.get(q, 0.0):>4.0%}" for q in QUEUES)
            + f" {r['h2d_gb_per_s']:>8.2f} {peak:>6.1f} / {planned:<5.1f}"
        )
    measured = {r["schedule"]: r["measured"]["throughput_tok_s"] for r in rows if "measured" in r}
    if "cgopipe static" in measured and "cgopipe continuous" in measured:
        ratio = measured["cgopipe continuous"] / measured["cgopipe static"]
        lines.append(f"cgopipe continuous / static: {ratio:.2f}x")
    base = measured.get("transformers+accelerate")
    for name, tput in measured.items():
        if base and name != "transformers+accelerate":
            lines.append(f"{name} / transformers+accelerate: {tput / base:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
