"""What `hrm validate` needs before it measures anything: enough memory for its largest run, and
the model's random weights written once as a real checkpoint (where, and how large, said)."""

from __future__ import annotations

import dataclasses
import itertools
import shutil
import sys
from pathlib import Path

# (batch sizes, (prompt length, ragged) pairs, generation lengths): ragged prompts spread their
# lengths over [L/2, 3L/2]; uniform ones all have L tokens
SWEEPS = {
    "quick": ((1, 16), ((16, False), (64, True)), (8,)),
    "full": ((1, 8, 32, 64), ((32, False), (128, True)), (16, 64)),
}
# the dtypes every run is swept in: --quick keeps bfloat16, the dtype offloading serves, as its
# profile does (executor/cpu_overhead.py): at Mixtral 8x7B's shape float32 took most of the
# profile's and the sweep's time and 12.5 of its 20.4 GB (docs/decisions.md, 2026-12-05)
SWEEP_DTYPES = {"quick": ("bfloat16",), "full": ("bfloat16", "float32")}
# offloaded runs on a CPU-only host: (batch, micro-batch, prompt length, generation length)
OFFLOADED = {"quick": (16, 8, 32, 8), "full": (32, 16, 64, 16)}


def check_memory(args) -> None:
    """The sweep's largest run against the memory available, before any checkpoint is written
    or any host time spent profiling."""
    from hrm.arch import resolve_model
    from hrm.cli.memory_check import check_runs

    arch = resolve_model(args.checkpoint or args.model)
    if args.layers is not None:
        arch = dataclasses.replace(arch, num_layers=args.layers)
    sweep = "quick" if args.quick else "full"
    batches, prompts, gens = SWEEPS[sweep]
    runs = [
        (b, length * 3 // 2 if ragged and b > 1 else length, g, d)
        for d, b, (length, ragged), g in itertools.product(
            SWEEP_DTYPES[sweep], batches, prompts, gens
        )
    ]
    b, _, length, g = OFFLOADED[sweep]
    runs += [(b, length * 3 // 2, g, d) for d in SWEEP_DTYPES[sweep]]
    check_runs(arch, runs, what=f"hrm validate of {arch.name}", layers_flag=args.random_weights)


def save_random_checkpoint(args, tmp: Path) -> Path:
    """The model's real architecture with random weights (_fill_random), saved by transformers
    into `tmp`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from hrm.arch import BUNDLED_DIR, resolve_model
    from hrm.errors import HrmError
    from hrm.io import load_json
    from hrm.units import format_bytes

    arch = resolve_model(args.model)  # the one place that checks the name
    path = Path(args.model)
    if not path.exists():
        path = BUNDLED_DIR / f"{args.model}.json"
    elif path.is_dir():
        path = path / "config.json"
    config = dict(load_json(path))
    if args.layers is not None:
        config["n_layers" if arch.model_type == "dbrx" else "num_hidden_layers"] = args.layers
        if "layer_types" in config:  # one per layer (transformers 5.x writes it for Qwen)
            config["layer_types"] = config["layer_types"][: args.layers]
    hf_config = AutoConfig.for_model(**config)
    if args.layers is not None:
        arch = dataclasses.replace(arch, num_layers=args.layers)
    size = arch.total_params * 2  # bfloat16
    free = shutil.disk_usage(tmp).free
    if free < size:
        raise HrmError(
            f"the random checkpoint of {format_bytes(size, 3)} does not fit in {tmp.parent} "
            f"({format_bytes(free, 3)} free); set TMPDIR to a larger directory"
        )
    with torch.device("meta"):  # no initialisation: _fill_random draws the weights
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    _fill_random(model)
    out = tmp / f"{arch.name}-random"
    print(
        f"hrm validate: random weights ({format_bytes(size, 3)} in bfloat16) go to a temporary "
        f"checkpoint in {tmp}, removed at the end",
        file=sys.stderr,
    )
    if args.quiet:  # transformers' own shard-writing bar ignores our --quiet otherwise
        hf_logging.disable_progress_bar()
    model.save_pretrained(out)
    return out


def _fill_random(model) -> None:
    """Weights as transformers initialises them (executor.checkpoint.init_kind), the rows of one
    drawn block per tensor tiled: what validate times does not depend on the values, and drawing
    every one of Mixtral 8x7B's 3.1 billion (2 layers) took 27 of its seconds, tiling 11."""
    import torch

    from executor.checkpoint import INIT_STD, init_kind

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind = init_kind(name, p.dim())
            if kind != "normal":
                p.fill_(1.0 if kind == "ones" else 0.0)
                continue
            rows = p.view(-1, p.shape[-1])
            n = min(rows.shape[0], 64)
            block = (torch.randn(n, rows.shape[1], generator=g) * INIT_STD).to(p.dtype)
            rows.copy_(block.repeat(-(-rows.shape[0] // n), 1)[: rows.shape[0]])
