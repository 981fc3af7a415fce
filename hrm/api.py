"""The Python API: `from hrm.api import generate`, what `hrm run` does, from Python.

It is `hrm run` itself: the keyword arguments become that command's flags, parsed and checked by
its parser, the requests are read as a request file's lines are, and the run goes through the
same job settling (resident, `plan=`, or planned for `hardware=`) and the one run driver. Errors
are HrmError with the message the command would print.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hrm.errors import HrmError


@dataclass(frozen=True, kw_only=True)
class Result:
    """One request's answer: its tokens, its text (None without a tokenizer), why it stopped
    ("stop": an end token or a stop string; "length": its max_tokens) and its token counts."""

    output_token_ids: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def generate(
    checkpoint: str | os.PathLike,
    requests: Sequence[Any],
    *,
    gen_len: int | None = None,
    plan: str | os.PathLike | None = None,
    hardware: str | os.PathLike | None = None,
    gpu_mem: str | None = None,
    cpu_mem: str | None = None,
    schedule: str | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    ignore_eos: bool = False,
    threads: int | None = None,
    progress: bool = False,
    batching: str = "continuous",
    max_tokens_per_pass: int | None = None,
) -> list[Result]:
    """Generate for each request with a local checkpoint; the answers in request order.

    requests: text prompts, lists of token ids, or dicts of one of prompt, prompt_token_ids or
    messages (rendered with the checkpoint's chat template), each with its own max_tokens,
    temperature, top_p, seed and stop strings if it likes. gen_len: the default and cap of
    max_tokens (None: every request gives its own). plan: a plan file (hrm plan -o) to run
    under; hardware: a profile to plan for first (with gpu_mem, cpu_mem, schedule), as
    `hrm run --hardware` does; neither: everything on `device`. progress: a progress bar on
    stderr. batching, max_tokens_per_pass: as `hrm run --batching` (docs/running.md)."""
    from hrm.cli import build_parser
    from hrm.cli.run import run_job
    from hrm.requests import requests_from

    flags = {"--gen-len": gen_len, "--plan": plan, "--hardware": hardware, "--gpu-mem": gpu_mem,
             "--cpu-mem": cpu_mem, "--schedule": schedule, "--dtype": dtype, "--device": device,
             "--temperature": temperature, "--top-p": top_p, "--seed": seed,
             "--threads": threads, "--batching": batching,
             "--max-tokens-per-pass": max_tokens_per_pass}  # fmt: skip
    argv = ["run", "--checkpoint", str(checkpoint), "--prompts", "requests"]
    argv += [str(x) for flag, value in flags.items() if value is not None for x in (flag, value)]
    argv += ["--ignore-eos"] * ignore_eos + ["--quiet"] * (not progress)
    args = _parse(build_parser(), argv)
    args.prompts, args.requests = None, requests_from(requests)

    def warn(message: str) -> None:
        if progress:
            print(f"hrm: {message}", file=sys.stderr)

    _, result = run_job(args, warn)
    return [Result(**result.outputs[i]) for i in range(len(requests))]


def _parse(parser, argv: list[str]):
    """`hrm run`'s arguments, a usage error as HrmError (argparse would exit)."""
    try:
        return parser.parse_args(argv)
    except SystemExit:
        raise HrmError(f"hrm.api.generate: invalid arguments {argv[1:]}") from None
