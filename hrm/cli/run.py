"""`hrm run`: generate with a real checkpoint and report measured prefill/decode time.

The executor does the work (executor/api.py); this module parses arguments, writes the outputs
atomically and assembles the RunRecord in `build_record`, the one place where a prediction for
the same run will be joined to the measurement.
"""

from __future__ import annotations

import argparse
import json

from hrm.plan import SCHEDULES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="generate with a Mixtral/DBRX checkpoint and measure throughput",
        description="Run batched generation on a local checkpoint directory (config.json + "
        "safetensors) and report measured prefill and decode time and throughput.",
    )
    weights = p.add_mutually_exclusive_group(required=True)
    weights.add_argument("--checkpoint", help="checkpoint directory")
    weights.add_argument(
        "--model",
        help="bundled model name or config.json: with --random-weights, its real architecture",
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="random weights made in memory for --model (speed runs; nothing is downloaded)",
    )
    p.add_argument("--layers", type=int, help="with --random-weights: keep this many layers")
    p.add_argument("--plan", help="run this plan (hrm plan -o plan.json): placement and schedule")
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="with --hardware: plan for this schedule, then run the best plan (cgopipe)",
    )
    p.add_argument("--gpu-mem", help="with --hardware: GPU memory to plan for, e.g. '16 GB'")
    p.add_argument("--cpu-mem", help="with --hardware: CPU memory to plan for, e.g. '64 GB'")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from OUTPUT.partial, skipping the batches already done (needs --output)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over, discarding an OUTPUT.partial a killed run left (needs --output)",
    )
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument(
        "--prompts", help='JSONL: {"prompt_token_ids": [...]} or {"prompt": "text"} per line'
    )
    prompts.add_argument("--prompt-len", type=int, help="random prompts of this many tokens")
    p.add_argument("--batch", type=int, help="number of random prompts (with --prompt-len)")
    p.add_argument("--seed", type=int, default=0, help="seed of random prompts and sampling (0)")
    p.add_argument("--gen-len", type=int, required=True, help="tokens to generate per prompt")
    p.add_argument("--device", default="cpu", help="cpu or cuda (cpu)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="weight and compute dtype (default: the checkpoint's)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0)")
    p.add_argument(
        "--ignore-eos", action="store_true", help="always generate --gen-len tokens per prompt"
    )
    p.add_argument(
        "--hardware",
        help="profile (bundled name or YAML): with a GPU (or --gpu-mem, --schedule) plan for it "
        "and run the best plan; a CPU-only profile adds the prediction of this resident run",
    )
    p.add_argument(
        "--cpu-gemm",
        default="auto",
        help="CPU GEMM path for 16-bit weights: auto (the faster per token count, from the "
        "--hardware profile of this host or a one-second probe), native or widened (auto)",
    )
    p.add_argument("--threads", type=int, help="CPU threads the run uses (default: torch's)")
    p.add_argument(
        "--output",
        help="JSONL of outputs, one line per prompt in input order (default: stdout, with the "
        "summary on stderr)",
    )
    p.add_argument("--json", action="store_true", help="print the RunRecord as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from executor.api import execute, torch_threads
    from executor.generate import Sampling
    from hrm.errors import HrmError
    from hrm.hardware import resolve_hardware
    from hrm.io import atomic_write_text, check_writable
    from hrm.profiling.host_gemm import cpu_gemm_for_run, host_differs

    def warn(message: str) -> None:
        print(f"hrm run: {message}", file=sys.stderr)

    planner_args = _check_flags(args)
    random_arch = _random_arch(args)
    output = check_writable(args.output) if args.output else None
    hardware = resolve_hardware(args.hardware) if args.hardware else None
    on_gpu = args.device.startswith("cuda")
    planned = args.plan is not None or (
        hardware is not None and (hardware.has_gpu or bool(planner_args))
    )
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if planned:
        from hrm.cli.run_plan import run_planned

        return run_planned(args, hardware, random_arch, sampling, output, warn)
    if args.resume:
        raise HrmError("--resume continues a planned run (--plan, or --hardware with a GPU)")
    if hardware is not None and on_gpu and not hardware.has_gpu:
        raise HrmError(
            f"--hardware {args.hardware} has no GPU, so it cannot predict a --device "
            f"{args.device} run; give a profile with a GPU or run on the cpu"
        )
    from hrm.cli.run_plan import run_spec

    spec = run_spec(args, random_arch, args.dtype)
    from hrm.cli.memory_check import check_resident_run

    check_resident_run(spec, random_weights=args.random_weights)

    def choose(checkpoint):  # at the run's own thread count, once the checkpoint has opened
        return cpu_gemm_for_run(
            spec.arch,
            spec.dtype,
            mode=args.cpu_gemm,
            hardware=hardware,
            weights=checkpoint.expert_gate_weights,
            warn=warn,
        )

    if hardware is not None and hardware.source == "measured":
        differs = host_differs(hardware)
        if differs:
            warn(f"warning: {differs}: the prediction is for that host")
    with torch_threads(args.threads):
        result = execute(
            spec,
            cpu_gemm=None if on_gpu else choose,
            sampling=sampling,
            ignore_eos=args.ignore_eos,
            quiet=args.quiet,
            warn=lambda message: warn(f"warning: {message}"),
        )
    lines = "".join(json.dumps(o) + "\n" for o in result.outputs)
    if output is not None:
        atomic_write_text(output, lines)
    record = build_record(result, hardware)
    if args.json:
        print(json.dumps(record.to_dict(), indent=2))
        return 0
    if output is None:
        print(lines, end="")
    print(format_summary(record), file=sys.stderr)
    return 0


def _check_flags(args) -> list[str]:
    """Flags that contradict each other or lack their partner, refused one line at a time;
    returns the planning flags given (gpu_mem, cpu_mem, schedule)."""
    from hrm.cpu_gemm import MODES
    from hrm.errors import HrmError

    if args.prompt_len is not None and args.batch is None:
        raise HrmError("--prompt-len needs --batch (the number of random prompts)")
    if args.prompts is not None and args.batch is not None:
        raise HrmError("--batch goes with --prompt-len; a --prompts file sets its own batch")
    if args.cpu_gemm not in MODES:
        raise HrmError(f"--cpu-gemm: unknown path {args.cpu_gemm!r}; use one of {', '.join(MODES)}")
    if args.threads is not None and args.threads < 1:
        raise HrmError(f"--threads must be at least 1, got {args.threads}")
    if args.resume and not args.output:
        raise HrmError("--resume continues OUTPUT.partial: give --output OUTPUT")
    if args.overwrite and not args.output:
        raise HrmError("--overwrite discards OUTPUT.partial: give --output OUTPUT")
    if args.resume and args.overwrite:
        raise HrmError("--resume continues OUTPUT.partial, --overwrite discards it: give one")
    planner_args = [f for f in ("gpu_mem", "cpu_mem", "schedule") if getattr(args, f)]
    if planner_args and (args.plan or not args.hardware):
        flag = "--" + planner_args[0].replace("_", "-")
        raise HrmError(
            f"{flag} is for planning with --hardware; "
            + ("a --plan has fixed it already: leave it out" if args.plan else "add --hardware")
        )
    return planner_args


def _random_arch(args):
    """The architecture of --model --random-weights (with --layers), or None for --checkpoint."""
    from hrm.arch import resolve_model
    from hrm.errors import HrmError

    if args.random_weights != (args.model is not None):
        raise HrmError(
            "--random-weights goes with --model (an architecture); a --checkpoint has weights"
            if args.random_weights
            else "--model runs random weights: add --random-weights, or give --checkpoint"
        )
    if args.layers is not None and not args.random_weights:
        raise HrmError("--layers goes with --random-weights (a checkpoint has its own layers)")
    if args.model is None:
        return None
    return resolve_model(args.model).first_layers(args.layers)


def build_record(result, hardware=None):
    """The RunRecord of a finished run, with the planner's prediction for the same run (same
    model, batch, prompt lengths, generation length, dtype and device, everything resident on
    that device, and on a CPU the GEMM path the run took) when a hardware profile is given."""
    from hrm.record import RunRecord
    from hrm.workload import Workload

    spec = result.spec
    # Prefill packs the prompts (no compute on padding), so the workload is unpadded.
    workload = Workload.from_prompt_lens(spec.prompt_lens, spec.gen_len, padding=False)
    predicted = None
    environment = dict(result.environment)
    if hardware is not None:
        from planner import MODEL_VERSION, predict_resident_run

        plan = predict_resident_run(
            spec.arch,
            hardware,
            workload,
            batch_size=len(spec.prompt_lens),
            dtype=spec.dtype,
            on_gpu=spec.device.startswith("cuda"),
            cpu_gemm=result.cpu_gemm,
        )
        predicted = {**plan.predicted.to_dict(), "busy_s": dict(plan.busy_s)}
        environment["model_version"] = MODEL_VERSION
    return RunRecord(
        model=spec.arch.name,
        hardware=hardware.name if hardware is not None else None,
        workload=workload.to_dict(),
        plan=None,
        predicted=predicted,
        measured=result.measured,
        environment=environment,
    )


def format_summary(record) -> str:
    m, env = record.measured, record.environment
    summary = (
        f"{record.model}: {env['batch_size']} prompts, {m.generated_tokens} tokens generated "
        f"({env['dtype']}, {env['device']}); prefill {m.prefill_s:.3f} s, "
        f"decode {m.decode_s:.3f} s, {m.throughput_tok_s:.1f} tok/s"
    )
    if record.predicted is None:
        return summary
    p = record.predicted
    return (
        f"{summary}\npredicted on {record.hardware}: prefill {p['prefill_s']:.3f} s, "
        f"decode {p['decode_s']:.3f} s, {p['throughput_tok_s']:.1f} tok/s "
        f"({100 * record.prediction_error:+.0f}% against measured)"
    )
