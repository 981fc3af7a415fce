"""`hrm validate`: a sweep of real runs, each with the planner's prediction, then `hrm report`;
exit status 1 when the model's error (MAPE) exceeds --max-mape.

The host is profiled first (quick, at the model's own shape) unless --hardware names a profile
of this very host: a stale or foreign profile would test the profile, not the model. The full
sweep profiles the host again before each timed pass (--profile-every pass), so that no
prediction uses a profile more than one pass old: on a VM whose speed moves by a quarter over
minutes, one profile was 25% off the whole of a 20-minute sweep (docs/decisions.md, 2026-12-03).
Every setting runs `--repeats` times, the passes interleaved, and the run-to-run spread is reported;
before and after each timed run one GEMM point of the profile is timed again
(hrm/profiling/host_speed.py), so that a host whose speed moves under the sweep shows as such: each
record keeps both shares, and the report gives them beside the run's error.
An untimed warm-up pass runs every setting first: the model predicts a long job's steady state,
and a setting's first run pays what a long job pays once (oneDNN builds a kernel per new GEMM
shape, 0.5-3 ms each in bf16 on AMX; first touch of the run's memory). How much slower that pass
ran is reported beside the spread.
Resident runs (the model on one device) are joined, on a CPU-only host, by every offloading
schedule at a forced-paging policy (nothing resident, two micro-batches), run with the CPU
standing in for the GPU and predicted with the stand-in profile (hrm/hardware/stand_in.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import tempfile
from pathlib import Path

from hrm.cli.validate_inputs import OFFLOADED, SWEEP_DTYPES, SWEEPS
from hrm.plan import SCHEDULES

# how often the host is profiled, by default per sweep: the quick sweep's passes take half a
# minute, and profiling before each would take it past its 4 minutes on 2 cores
PROFILE_EVERY = {"quick": "sweep", "full": "pass"}
# timed runs of each setting, by default per sweep: the full sweep's three let a setting's median
# pass over one run the host slowed (sweep 12's worst run took 1.66x its identical twin); the
# quick sweep times one, to stay within 4 minutes at Mixtral 8x7B's shape on 2 cores (two, after
# a warm-up of every setting, gave the same MAPE in the same half hour: docs/decisions.md,
# 2026-12-05)
REPEATS = {"quick": 1, "full": 3}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "validate",
        help="run a sweep with the executor, report predicted against measured, fail past a MAPE",
        description="Profile this host (or take --hardware, a profile of it), run a sweep of "
        "batch sizes, prompt lengths (uniform and ragged), generation lengths and dtypes, and "
        "each schedule on the CPU standing in for a GPU (cgopipe also with continuous batching "
        "of a job of mixed max_tokens, predicted pass by pass), write "
        "each RunRecord under DIR/runs/ and the report (hrm report) into DIR, and exit with "
        "status 1 when the mean absolute percentage error over the settings (each the median of "
        "its runs' errors) exceeds --max-mape.",
    )
    p.add_argument("--hardware", help="a measured profile of this host (default: profile it now)")
    p.add_argument("--checkpoint", help="checkpoint directory to run")
    p.add_argument("--model", help="with --random-weights: bundled name or config.json")
    p.add_argument(
        "--random-weights", action="store_true", help="the model's architecture, random weights"
    )
    p.add_argument("--layers", type=int, help="with --random-weights: this many layers")
    p.add_argument("--quick", action="store_true", help="a small sweep (minutes on 2 cores)")
    p.add_argument(
        "--repeats",
        type=int,
        help="timed runs of each setting, interleaved (default: 3 for the full sweep, 2 for "
        "--quick); a setting's error is the median of its runs' errors",
    )
    p.add_argument(
        "--profile-every",
        choices=("sweep", "pass"),
        help="profile this host once before the sweep, or again before each timed pass (default: "
        "pass for the full sweep, sweep for --quick, whose passes take half a minute)",
    )
    p.add_argument("--max-mape", type=float, default=0.15, help="fail above this MAPE (0.15)")
    p.add_argument("--threads", type=int, help="CPU threads for the runs (default: torch's)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="directory to write")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hrm.errors import HrmError
    from hrm.hardware import resolve_hardware
    from hrm.io import check_writable_dir
    from hrm.profiling.host_gemm import host_differs

    check_writable_dir(args.output)
    if not 0 < args.max_mape < 10:
        raise HrmError(f"--max-mape is a fraction (0.15 = 15%), got {args.max_mape:g}")
    if args.repeats is not None and args.repeats < 1:
        raise HrmError(f"--repeats must be at least 1, got {args.repeats}")
    if args.threads is not None and args.threads < 1:
        raise HrmError(f"--threads must be at least 1, got {args.threads}")
    if bool(args.checkpoint) == bool(args.random_weights):
        raise HrmError("give --checkpoint DIR, or --model M --random-weights [--layers L]")
    if args.random_weights and not args.model:
        raise HrmError("--random-weights needs --model (a bundled name or a config.json)")
    if args.layers is not None and (not args.random_weights or args.layers < 1):
        raise HrmError("--layers is a positive layer count for --random-weights")
    if args.profile_every == "pass" and args.hardware:
        raise HrmError(
            "--profile-every pass profiles this host before each pass; leave out --hardware, or "
            "give --profile-every sweep"
        )
    hardware = resolve_hardware(args.hardware) if args.hardware else None
    if hardware is not None:
        differs = host_differs(hardware)
        if differs:
            raise HrmError(
                f"--hardware: {differs}; a sweep here needs a profile of this host "
                "(leave out --hardware to profile it first)"
            )
    from hrm.cli.validate_inputs import check_memory, save_random_checkpoint

    check_memory(args)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = (
            Path(args.checkpoint) if args.checkpoint else save_random_checkpoint(args, Path(tmp))
        )
        return _validate(args, checkpoint, hardware)


def _validate(args, checkpoint: Path, hardware) -> int:
    from executor.api import torch_threads
    from hrm.arch import resolve_model
    from hrm.profiling.host_speed import HostSpeedCheck
    from hrm.progress import progress_bar

    sweep = "quick" if args.quick else "full"
    batches, prompts, gens = SWEEPS[sweep]
    settings = list(itertools.product(SWEEP_DTYPES[sweep], batches, prompts, gens))
    schedules = SCHEDULES if hardware is None or not hardware.has_gpu else ()
    offloaded = _offloaded_cases(sweep, schedules)
    records: dict[str, dict] = {}
    spreads: dict[str, list[float]] = {}
    warm_up: dict[str, float] = {}  # setting -> the untimed first pass's throughput

    def keep(name: str, rep: int | None, record: dict) -> None:
        """One finished run: its record under name-rep and its throughput in name's spread, or,
        from the warm-up pass (rep None), its throughput alone."""
        throughput = record["measured"]["throughput_tok_s"]
        bar.update()
        if rep is None:
            warm_up[name] = throughput
            return
        run = f"{name}-{rep + 1}"
        speed.check(run, record["environment"]["dtype"], after=True)
        if args.random_weights:
            record["environment"]["weights"] = "random"
        if host_speed := speed.of_run(run):
            record["environment"]["host_speed"] = host_speed
        if every_pass:
            record["environment"]["profile"] = _profile_file(rep, every_pass)
        records[run] = record
        spreads.setdefault(name, []).append(throughput)

    def check_speed(name: str, rep: int | None, dtype: str) -> None:
        """Before a timed run (not the warm-up pass): the host's speed now against the profile's,
        under the name `keep` files the run by; `keep` checks it again right after the run."""
        if rep is not None:
            speed.check(f"{name}-{rep + 1}", dtype)

    repeats = args.repeats or REPEATS[sweep]
    every_pass = hardware is None and (args.profile_every or PROFILE_EVERY[sweep]) == "pass"
    profiles: dict[int, object] = {}  # timed pass -> the profile that predicted its runs
    settle: dict[int, float] = {}  # timed pass -> throughput of the untimed run after its profile
    with torch_threads(args.threads):
        hardware = hardware or _profile_host(checkpoint, args.quiet, sweep)
        speed = HostSpeedCheck.for_profile(resolve_model(checkpoint), hardware, SWEEP_DTYPES[sweep])
        warm = len(_warmed(settings, None, sweep)) + len(_warmed(offloaded, None, sweep, _mode))
        total = repeats * (len(settings) + len(offloaded)) + warm
        bar = progress_bar(total=total, desc="validate", quiet=args.quiet)
        with bar:
            # the warm-up pass, then the timed passes interleaved: drift hits every setting
            for rep in (None, *range(repeats)):
                if rep is not None and every_pass:
                    hardware, speed, settle[rep] = _reprofile(checkpoint, sweep, speed,
                                                              settings[0], bar, rep)  # fmt: skip
                if rep is not None:
                    profiles[rep] = hardware
                for setting in _warmed(settings, rep, sweep):
                    name = _setting_name(*setting)
                    check_speed(name, rep, setting[0])
                    keep(name, rep, _resident_run(checkpoint, setting, hardware))
                for dtype, schedule, batching in _warmed(offloaded, rep, sweep, _mode):
                    shape = OFFLOADED[sweep]
                    how = schedule if batching == "static" else f"{schedule}-{batching}"
                    name = f"{dtype}-{how}-b{shape[0]}-m{shape[1]}-p{shape[2]}r-g{shape[3]}"
                    check_speed(name, rep, dtype)
                    record = _offloaded_run(checkpoint, hardware, dtype, (schedule, batching),
                                            shape)  # fmt: skip
                    keep(name, rep, record)

    def notes(rows) -> list[str]:
        out = _spread_notes(spreads, warm_up, hardware)
        out += _profile_notes(profiles, speed) if every_pass else []
        out += _settle_notes(settle, _setting_name(*settings[0]), spreads)
        return out + speed.summary({row.name: row.error for row in rows})

    # one file per profile: with --profile-every sweep every pass has the same one
    saved = {_profile_file(rep, every_pass): profile for rep, profile in profiles.items()}
    return _write_results(args, hardware, records, notes, saved)


def _reprofile(checkpoint: Path, sweep: str, speed, first_setting, bar, rep: int):
    """(profile, speed check, settling throughput) before timed pass `rep`: this host profiled
    again, then one untimed run, since the first run after a profile is not steady
    (_settle_notes)."""
    bar.set_description(f"validate (profiling for pass {rep + 1})")
    hardware = _profile_host(checkpoint, quiet=True, sweep=sweep)
    settle = _resident_run(checkpoint, first_setting, hardware)["measured"]["throughput_tok_s"]
    bar.set_description("validate")
    return hardware, speed.against(hardware), settle


def _write_results(args, hardware, records: dict, notes, profiles: dict) -> int:
    """The records under DIR/runs, the report with `notes(rows)`, the profiles that predicted
    them; exit status 1 when the MAPE over settings exceeds --max-mape."""
    from hrm.report import load_records, summaries, write_report

    out = Path(args.output)
    with tempfile.TemporaryDirectory() as staging:
        runs = Path(staging) / "runs"
        runs.mkdir()
        for name, record in records.items():
            (runs / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
        rows = load_records(sorted(runs.glob("*.json")))
        title = f"{rows[0].model} on {hardware.name}: predicted against measured"
        write_report(rows, out, title=title, notes=notes(rows))
        (out / "runs").mkdir(exist_ok=True)
        for path in runs.iterdir():
            path.replace(out / "runs" / path.name)
        for name, profile in profiles.items():
            profile.save(out / name)
    overall = list(summaries(rows).values())[-1]["all"]
    print(
        f"{overall.settings} settings (median of their runs): MAPE {overall.mape:.1%}, worst "
        f"{overall.worst.error:+.1%} ({overall.worst.name}); {overall.runs} runs one by one: "
        f"MAPE {overall.run_mape:.1%}, worst {overall.worst_run.error:+.1%} "
        f"({overall.worst_run.name}); wrote {out / 'report.md'}"
    )
    if overall.mape > args.max_mape:
        print(
            f"hrm validate: MAPE {overall.mape:.1%} exceeds --max-mape {args.max_mape:.0%}",
            file=sys.stderr,
        )
        return 1
    return 0


def _offloaded_cases(sweep: str, schedules) -> list[tuple[str, str, str]]:
    """(dtype, schedule, batching): every schedule's static batches, and cgopipe's continuous
    batching of a mixed job."""
    dtypes = SWEEP_DTYPES[sweep]
    cases = [(d, s, "static") for d, s in itertools.product(dtypes, schedules)]
    return cases + [(d, "cgopipe", "continuous") for d in dtypes if schedules]


def _warmed(runs: list, rep: int | None, sweep: str, kind=None) -> list:
    """The runs of pass `rep`: all of them in a timed pass; in the untimed warm-up pass (rep
    None) all of them in the full sweep, and with --quick the first of each `kind` (a function
    of a run; None: each run its own kind). A run's one-off costs, the first touch of its
    memory and oneDNN's kernels for its GEMM row counts, are those of the runs of its kind. The
    offloaded runs of one batching mode share them, and their warm-up took about a minute of
    the quick sweep at Mixtral 8x7B's shape. A resident setting meets row counts of its own
    (its batch and prompts): warmed by the first alone, later ones' first runs prefilled
    2.5-3.8x slower than their repeats (docs/decisions.md, 2026-12-06)."""
    if rep is not None or sweep != "quick" or kind is None:
        return runs
    first: dict = {}
    for run in runs:
        first.setdefault(kind(run), run)
    return list(first.values())


def _mode(run: tuple) -> str:
    """An offloaded run's kind for the warm-up: its batching mode (static or continuous)."""
    return run[2]


def _resident_run(checkpoint: Path, setting, hardware) -> dict:
    """One resident run of `setting` on the CPU, predicted with `hardware`: the RunRecord as a
    dict."""
    from executor.api import prepare_run
    from executor.run import execute
    from hrm.cli.records import run_record
    from hrm.policy import Policy
    from hrm.profiling.host_gemm import cpu_gemm_chooser

    dtype, batch, (length, ragged), gen = setting
    spec = prepare_run(checkpoint, gen_len=gen, prompt_len=length, batch=batch, dtype=dtype,
                       device="cpu")  # fmt: skip
    spec = dataclasses.replace(spec, prompts=_prompts(spec, batch, length, ragged))
    policy = Policy.resident(batch, dtype, on_gpu=False)
    choose = cpu_gemm_chooser(spec.arch, dtype, mode="auto", hardware=hardware)
    result = execute(spec, policy, "serial", cpu_gemm=choose, quiet=True)
    return run_record(spec, result, policy=policy, schedule="serial", profile=hardware).to_dict()


def _offloaded_run(checkpoint: Path, hardware, dtype: str, how: tuple[str, str], shape) -> dict:
    """One schedule at a forced-paging policy on the CPU standing in for the GPU, predicted with
    the stand-in profile of `hardware`: the RunRecord as a dict. how: (schedule, batching); a
    continuous run's job is twice the batch, the requests' max_tokens mixed (_mixed_job)."""
    from executor.api import prepare_run
    from executor.run import execute
    from hrm.cli.records import run_record
    from hrm.hardware.stand_in import stand_in_profile
    from hrm.policy import Policy
    from hrm.profiling.host_gemm import cpu_gemm_chooser
    from planner import predict

    batch, mu, length, gen = shape
    spec = prepare_run(
        checkpoint, gen_len=gen, prompt_len=length, batch=batch, dtype=dtype, device="cpu"
    )
    schedule, batching = how
    spec = dataclasses.replace(spec, prompts=_prompts(spec, batch, length, True))
    if batching == "continuous":
        spec = _mixed_job(spec, batch, length, gen)
    policy = Policy(
        batch_size=batch,
        micro_batch_size=mu,
        attention_on_gpu=schedule == "gpu-attention",
        ffn_on_gpu=True,
        weights_gpu_fraction=0.0,
        kv_gpu_fraction=0.0,
        weight_dtype=dtype,
        kv_dtype=dtype,
    )
    stand_in = stand_in_profile(hardware, gpu_memory_bytes=hardware.cpu.memory_bytes / 2)
    workload = spec.workload()
    choose = cpu_gemm_chooser(spec.arch, dtype, mode="auto", hardware=hardware)
    result = execute(spec, policy, schedule, cpu_gemm=choose, quiet=True, batching=batching)
    plan = predict(spec.arch, stand_in, workload, policy, schedule, cpu_gemm=result.cpu_gemm)
    record = run_record(spec, result, policy=policy, schedule=schedule, profile=stand_in, plan=plan)
    return record.to_dict()


def _mixed_job(spec, batch: int, length: int, gen: int):
    """`spec` with 2 x batch ragged prompts whose max_tokens cycle through gen/4, gen/2 and gen:
    continuous batching admits a request as another ends."""
    from hrm.requests import Request

    prompts = _prompts(spec, 2 * batch, length, True)
    steps = (max(1, gen // 4), max(1, gen // 2), gen)
    requests = tuple(Request(line=i + 1, prompt=list(p), max_tokens=steps[i % 3])
                     for i, p in enumerate(prompts))  # fmt: skip
    return dataclasses.replace(spec, prompts=prompts, requests=requests)


def _profile_file(rep: int, every_pass: bool) -> str:
    """Where the profile that predicted timed pass `rep` is written in the output directory."""
    return f"hardware-pass{rep + 1}.yaml" if every_pass else "hardware.yaml"


def _profile_notes(profiles: dict, speed) -> list[str]:
    """How far the profiles of the timed passes moved from one another: each pass's rate at the
    host check's GEMM point, per dtype, and its memory bandwidth."""
    from hrm.units import format_bandwidth, format_flops

    parts = []
    for rep, profile in profiles.items():
        rates = ", ".join(
            f"{dtype} {format_flops(rate)}" for dtype, rate in speed.rates_of(profile).items()
        )
        bandwidth = format_bandwidth(profile.cpu.memory_bandwidth_bytes_per_s)
        parts.append(f"pass {rep + 1} ({_profile_file(rep, True)}): {rates}; read {bandwidth}")
    return [
        "Each timed pass was predicted by a quick profile taken right before it "
        f"(--profile-every pass). At the host check's GEMM point: {'; '.join(parts)}.",
        "",
    ]


def _setting_name(dtype: str, batch: int, prompt: tuple[int, bool], gen: int) -> str:
    length, ragged = prompt
    return f"{dtype}-b{batch}-p{length}{'r' if ragged else 'u'}-g{gen}"


def _settle_notes(settle: dict[int, float], name: str, spreads: dict[str, list[float]]) -> list:
    """How much slower the untimed run right after each pass's profile was than the timed runs
    of its setting (`name`): what that run would have cost the pass's first timed run."""
    import statistics

    if not settle or name not in spreads:
        return []
    timed = statistics.median(spreads[name])
    parts = ", ".join(f"pass {rep + 1} {1 - t / timed:+.1%}" for rep, t in settle.items())
    return [
        f"After each pass's profile one untimed run of {name} came before the timed ones: the "
        "first run after a profile pays again what the warm-up pass paid (the run's memory sits "
        "idle during the profile, and on a VM that pages out memory idle for a minute the next "
        "run reads the checkpoint back from disk and is slow on first touch of the rest; docs/"
        f"decisions.md, 2026-12-04). It was slower than that setting's timed runs by: {parts}.",
        "",
    ]


def _prompts(spec, batch: int, length: int, ragged: bool) -> tuple[tuple[int, ...], ...]:
    """`batch` random prompts of `length` tokens, or of lengths spread over [L/2, 3L/2]."""
    import torch

    g = torch.Generator().manual_seed(batch * 1000 + length)
    lens = (
        torch.linspace(max(1, length // 2), length * 3 // 2, batch).round().int().tolist()
        if ragged and batch > 1
        else [length] * batch
    )
    vocab = spec.arch.vocab_size
    return tuple(tuple(torch.randint(0, vocab, (n,), generator=g).tolist()) for n in lens)


def _profile_host(checkpoint: Path, quiet: bool, sweep: str):
    """A quick profile of this host at the model's shape, taken right before the sweep, of the
    dtypes the sweep runs (the full sweep's with the fixed costs of both, as before --quick was
    cut)."""
    from executor.cpu_overhead import PRESETS as TIMED
    from hrm.arch import resolve_model
    from hrm.cli.profile import with_launch_overhead
    from hrm.profiling import PRESETS, measure_profile

    arch = resolve_model(checkpoint)
    profile = measure_profile(
        plan=dataclasses.replace(PRESETS["quick"], cpu_dtypes=SWEEP_DTYPES[sweep]),
        device="cpu",
        arch=arch,
        name="this-host",
        command="hrm validate (quick profile before the sweep)",
        quiet=quiet,
        warn=lambda message: print(f"hrm validate: warning: {message}", file=sys.stderr),
    )
    timed = TIMED["quick" if sweep == "quick" else "pass"]
    return with_launch_overhead(profile, arch, quick=True, timed=timed)


def _spread_notes(
    spreads: dict[str, list[float]], warm_up: dict[str, float], hardware
) -> list[str]:
    """Run-to-run spread of measured throughput, (max - min) / median per setting, and how much
    slower the warm-up pass ran than the median of the timed ones."""
    import statistics

    values = {
        name: (max(v) - min(v)) / statistics.median(v) for name, v in spreads.items() if len(v) > 1
    }
    notes = [
        "## Conditions",
        "",
        f"Profile: {hardware.name} ({hardware.description}); CPU "
        f"{hardware.provenance.get('cpu_model', '?')}, matrix features "
        f"{', '.join(hardware.provenance.get('cpu_matrix_features', [])) or 'unknown'}, "
        f"last-level cache {_cache_size(hardware)}. "
        "Schedules: resident (the model held by one device) and, on a CPU-only host, every "
        "offloading schedule at a forced-paging policy (nothing resident, two micro-batches) "
        "with the CPU standing in for the GPU, predicted by the stand-in profile "
        f"({hardware.name}-stand-in: the CPU's own curves, a memcpy link, queues that add up).",
        "",
    ]
    if values:
        worst = max(values, key=values.get)
        notes += [
            f"Run-to-run spread of measured throughput over the interleaved repeats: median "
            f"{statistics.median(values.values()):.1%}, largest {values[worst]:.1%} ({worst}).",
            "",
        ]
    slowdown = {
        name: 1 - warm_up[name] / statistics.median(v)
        for name, v in spreads.items()
        if name in warm_up
    }
    if slowdown:
        worst = max(slowdown, key=slowdown.get)
        notes += [
            "The untimed warm-up pass (each setting's first run; with --quick, every resident "
            "setting and the first offloaded one of each batching mode) was slower than the timed "
            f"passes by {statistics.median(slowdown.values()):.1%} at the median, at most "
            f"{slowdown[worst]:.1%} ({worst}): the one-off costs a long job does not repeat "
            "(kernel creation per new GEMM shape, first touch of memory).",
            "",
        ]
    return notes


def _cache_size(hardware) -> str:
    from hrm.profiling.host_gemm import recorded_cache_bytes
    from hrm.units import format_bytes

    size = recorded_cache_bytes(hardware)
    return format_bytes(size) if size else "unknown"
