"""What `hrm plan` plans for: the model (with --layers), the workload from the lengths given or
from a prompts file, and the job's size, so a plan never assumes more prompts than there are."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hrm.errors import HrmError
from hrm.units import format_duration, parse_bandwidth, parse_bytes


@dataclass(frozen=True, kw_only=True)
class Job:
    """The whole batch job: how many prompts (None: only a token count was given) and how many
    tokens they generate in all."""

    prompts: int | None
    tokens: float
    lengths: tuple[tuple[int, int], ...] = ()  # (prompt, max new tokens) of each prompt given

    def hours(self, throughput_tok_s: float) -> float:
        return self.tokens / throughput_tok_s / 3600.0

    def describe(self, throughput_tok_s: float, price_per_hour: float | None) -> str:
        what = (
            f"{self.prompts} prompts, {self.tokens:.0f} generated tokens"
            if self.prompts is not None
            else f"{self.tokens:.4g} generated tokens"
        )
        hours = self.hours(throughput_tok_s)
        cost = (
            f", {price_per_hour * hours:.2f} USD at {price_per_hour:g}/h" if price_per_hour else ""
        )
        return f"job: {what} in {format_duration(hours * 3600)} at the plan's throughput{cost}"

    def to_dict(self, throughput_tok_s: float, price_per_hour: float | None) -> dict:
        hours = self.hours(throughput_tok_s)
        return {
            "prompts": self.prompts,
            "tokens": self.tokens,
            "hours": hours,
            "cost": price_per_hour * hours if price_per_hour else None,
        }


def model(args):
    """--model, cut to its first --layers layers when given (as `hrm run --layers` runs it)."""
    from hrm.arch import resolve_model

    return resolve_model(args.model).first_layers(args.layers)


DRAWN_REQUESTS = 1000  # requests drawn from length ranges without --requests
DRAW_SEED = 0  # the same ranges draw the same job, run after run


def lengths_given(text: str | None, flag: str, integer: bool):
    """--prompt-len or --gen-len: None, a number, or a range LO-HI (a tuple of whole
    numbers); anything else refused in one line."""
    if text is None:
        return None
    lo, dash, hi = text.strip().partition("-")
    try:
        if dash:
            value = (int(lo), int(hi))
            if not 1 <= value[0] <= value[1]:
                raise ValueError
            return value
        value = int(text) if integer else float(text)
    except ValueError:
        raise HrmError(
            f"{flag} {text!r}: give a {'whole ' if integer else ''}number of tokens, or a range "
            "LO-HI of whole numbers with 1 <= LO <= HI"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise HrmError(f"{flag} must be positive, got {text}")
    return value


def workload_and_job(args, arch):
    """The Workload to plan and the Job (None without --prompts, --dataset-tokens or a length
    range); the lengths fit the model's positions."""
    from hrm.workload import Workload

    args.prompt_len = lengths_given(args.prompt_len, "--prompt-len", integer=False)
    args.gen_len = lengths_given(args.gen_len, "--gen-len", integer=True)
    ranges = isinstance(args.prompt_len, tuple) or isinstance(args.gen_len, tuple)
    if args.prompts is not None and args.requests is not None:
        raise HrmError("--prompts is the job; --requests sizes a job of --prompt-len and "
                       "--gen-len: give one of them")  # fmt: skip
    if (ranges or args.requests is not None) and args.prompts is None:
        return _drawn(args, arch)
    if isinstance(args.gen_len, tuple):
        raise HrmError("--prompts gives each request's max_tokens; --gen-len with it is one "
                       "number, their default and cap")  # fmt: skip
    if args.prompts is not None:
        if args.prompt_len is not None or args.max_prompt_len is not None:
            raise HrmError(
                "--prompts gives the prompt lengths; leave out --prompt-len and --max-prompt-len"
            )
        lens, answers = prompt_lengths(Path(args.prompts), args.model, args.gen_len, args.tokenizer)
        workload = Workload.from_prompt_lens(lens, max(answers), args.padding, answers)
        job = Job(prompts=len(lens), tokens=float(sum(answers)),
                  lengths=tuple(zip(lens, answers, strict=True)))  # fmt: skip
    else:
        if args.tokenizer is not None:
            raise HrmError(
                "--tokenizer counts the text of --prompts; give --prompts or leave it out"
            )
        if args.gen_len is None:
            raise HrmError("--gen-len: give the tokens each sequence generates")
        workload = _given_workload(args)
        job = None
        if args.dataset_tokens is not None:
            if not math.isfinite(args.dataset_tokens) or args.dataset_tokens <= 0:
                raise HrmError(f"--dataset-tokens must be positive, got {args.dataset_tokens:g}")
            job = Job(prompts=None, tokens=args.dataset_tokens)
    arch.check_positions(workload.prompt_len_max, workload.gen_len, "the longest prompt")
    return workload, job


def _drawn(args, arch):
    """A job of --requests requests (default DRAWN_REQUESTS) whose prompt and generation
    lengths are drawn uniformly from the ranges given (a number is every request's), with a
    fixed seed."""
    if args.gen_len is None:
        raise HrmError("--gen-len: give the tokens each sequence generates (or a range LO-HI)")
    if args.prompt_len is None:
        raise HrmError("give --prompt-len (a mean, or a range LO-HI) or --prompts FILE.jsonl")
    if args.max_prompt_len is not None:
        raise HrmError("--max-prompt-len: a range LO-HI of --prompt-len gives the longest itself")
    count = DRAWN_REQUESTS if args.requests is None else args.requests
    if count < 1:
        raise HrmError(f"--requests must be at least 1, got {count}")
    workload, job = drawn_job(args.prompt_len, args.gen_len, count, args.padding)
    arch.check_positions(workload.prompt_len_max, workload.gen_len, "the longest prompt")
    return workload, job


def drawn_job(prompt, gen, count: int, padding: bool = False):
    """The Workload and Job of `count` requests whose (prompt, max new tokens) are each drawn
    uniformly from its range (LO, HI), or a number for all; seeded with DRAW_SEED."""
    import random

    from hrm.workload import Workload

    rng = random.Random(DRAW_SEED)

    def draw(given):
        return rng.randint(*given) if isinstance(given, tuple) else math.ceil(given)

    lengths = [(draw(prompt), draw(gen)) for _ in range(count)]
    lens, answers = [p for p, _ in lengths], [g for _, g in lengths]
    workload = Workload.from_prompt_lens(lens, max(answers), padding, answers)
    return workload, Job(prompts=count, tokens=float(sum(answers)), lengths=tuple(lengths))


def _given_workload(args):
    from hrm.workload import Workload

    if args.prompt_len is None:
        raise HrmError("give --prompt-len (the mean prompt length) or --prompts FILE.jsonl")
    longest = args.max_prompt_len if args.max_prompt_len is not None else math.ceil(args.prompt_len)
    if longest <= 0:
        raise HrmError(f"--max-prompt-len must be positive, got {longest}")
    return Workload(
        prompt_len_mean=args.prompt_len,
        prompt_len_max=longest,
        gen_len=args.gen_len,
        padding=args.padding,
    )


def prompt_lengths(
    path: Path, model: str, gen_len: int | None, tokenizer_dir: str | None = None
) -> tuple[list[int], list[int]]:
    """Every prompt's length in tokens, and its most new tokens (its max_tokens capped at
    --gen-len, else --gen-len): token ids counted as they are, text tokenized (and chat messages
    rendered) with the tokenizer of --tokenizer, else of the --model checkpoint directory; a
    bundled config has none, so text without --tokenizer is refused before any line is read."""
    from hrm.requests import answer_lengths, prompt_ids, read_requests

    requests = read_requests(path)
    tokenizer = None
    where = f"--model {model}"
    texts = sum(not isinstance(r.prompt, list) for r in requests)
    if texts:
        from executor.checkpoint import load_tokenizer

        if tokenizer_dir is not None:
            where = f"--tokenizer {tokenizer_dir}"
            if not Path(tokenizer_dir).is_dir():
                raise HrmError(f"{where}: no such folder; give the checkpoint you will run")
        directory = _tokenizer_dir(model, tokenizer_dir)
        tokenizer = load_tokenizer(directory) if directory is not None else None
        if tokenizer is None:
            raise HrmError(
                f"{path}: {texts} of its {len(requests)} prompts are text, and {where} has no "
                "tokenizer to count them; give --tokenizer DIR (the checkpoint you will run, or "
                "its tokenizer's folder)"
            )
    lens = [len(prompt_ids(r, tokenizer, where, path)) for r in requests]
    return lens, answer_lengths(requests, gen_len, path)


def _tokenizer_dir(model: str, tokenizer_dir: str | None) -> Path | None:
    """The folder to read a tokenizer from: --tokenizer, else the --model checkpoint's."""
    if tokenizer_dir is not None:
        return Path(tokenizer_dir)
    directory = Path(model)
    directory = directory.parent if directory.name == "config.json" else directory
    return directory if directory.is_dir() else None


def max_batch(args, job: Job | None) -> int | None:
    """The largest N to plan: --max-batch-size, and never more than the prompts there are."""
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise HrmError(f"--max-batch-size must be at least 1, got {args.max_batch_size}")
    caps = [c for c in (args.max_batch_size, job.prompts if job else None) if c is not None]
    return min(caps) if caps else None


def hardware_of(args, name: str | None = None):
    """The named machine (default --hardware) with --cpu-mem, --gpu-mem and --pcie applied. A
    CPU-only machine given --gpu-mem has its CPU stand in for a GPU of that size (the offloaded
    schedules as `hrm validate` runs them there)."""
    from hrm.hardware import resolve_hardware

    hardware = resolve_hardware(name or args.hardware)
    if not hardware.has_gpu and args.gpu_mem and not args.pcie:
        from hrm.hardware.stand_in import stand_in_profile

        cpu = parse_bytes(args.cpu_mem, "--cpu-mem") if args.cpu_mem else None
        gpu = parse_bytes(args.gpu_mem, "--gpu-mem")
        return stand_in_profile(hardware.with_resources(cpu_memory_bytes=cpu), gpu)
    return hardware.with_resources(
        cpu_memory_bytes=parse_bytes(args.cpu_mem, "--cpu-mem") if args.cpu_mem else None,
        gpu_memory_bytes=parse_bytes(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None,
        link_bytes_per_s=parse_bandwidth(args.pcie, "--pcie") if args.pcie else None,
    )


def what_if(arch, hardware, weights: str, kv: str) -> str | None:
    """Why the executor could not run a plan in these dtypes (None: it could), so that such a
    plan is shown as a what-if and never written for `hrm run`; refused outright where the
    machine has no rate for the weights' dtype either (HardwareProfile.unrated)."""
    from hrm.formats import is_compact, kv_dtype_problem
    from hrm.policy import RUN_DTYPES

    problem = hardware.unrated(weights)
    if problem:
        raise HrmError(f"--dtype {weights}: {problem}")
    if weights not in RUN_DTYPES:
        return f"the executor runs no {weights} weights (it runs {', '.join(RUN_DTYPES)})"
    if is_compact(kv):
        return None  # its format is checked by the planner (planner.setting)
    return kv_dtype_problem(kv, hardware.compute_dtype(weights), arch.head_dim)
