"""The executor's fixed cost on a CPU, measured at the model's own shapes.

A CPU decode step spends time beyond its GEMMs and its attention stage: Python, torch's
dispatcher, the host read of the routing counts, and small elementwise kernels that run far
below the rate they reach on a prefill chunk. Timed on a miniature of the model (hidden 64, the
GPU's way: executor/overhead.py) that time came out a third of what the model's own shapes
take (bench model, bfloat16, batch 1: 1.2 ms per step against 4.1 ms; docs/decisions.md,
2026-12-04): between two small ops a real step streams megabytes of weights through the caches,
so the interpreter and each kernel start cold, and the kernels act on hidden-sized rows.

So it is timed here on the executor's own decode at the model's hidden size, widths, heads,
experts and vocabulary, at 1 and 4 layers and at 1 and 64 sequences, and what the planner prices
elsewhere is taken out:
  rest(L, b) = decode time - its GEMM calls - its decode-attention stages
               - the elementwise passes hrm.roofline.ops counts, at the profile's elementwise rate
             = per_step + L * (per_layer + touched(b) * per_expert)
each GEMM and the attention stage being priced by its own measured curve. The configurations
are timed in rounds, one sample of each per round, and each takes the median of its rounds, as
the GEMM sweeps do (a VM whose speed drifts then moves all four alike).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import torch

from executor.checkpoint import INIT_STD, Checkpoint, ExpertWeights, ModelWeights
from executor.generate import generate
from executor.model import MoEModel
from executor.overhead import assemble_weights
from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.hardware.parts import LaunchOverhead
from hrm.roofline.ops import expected_distinct_experts, layer_ops
from hrm.rules.cpu_gemm import CpuGemmChoice

LAYERS = (1, 4)  # the layer counts timed: their difference is three layers' worth
PROMPT_LEN = 1  # prefill is not what is timed: keep it short
BATCHES = (1, 64)  # top-k experts touched, then (nearly) all of them


@dataclass(frozen=True)
class Preset:
    """How much a profile preset times: `rounds` samples of each configuration, each of
    `decode_steps` steps, in `dtypes`. The elementwise rate (executor/overhead.py) is the median
    of `elementwise_repeats` calls, in `dtypes` too.

    --quick keeps within its 2 minutes on 2 cores at Mixtral 8x7B's shape by timing less of
    the same thing: fewer rounds of fewer steps, in bfloat16 alone (the dtype offloading serves;
    the others take its figures, DeviceSpec.launch_overhead_for). float32 at 64 sequences and 4
    layers runs its expert GEMMs at full rate, and those (taken out again) were 141 s of a 357 s
    quick profile (docs/decisions.md, 2026-12-05)."""

    rounds: int
    decode_steps: int
    dtypes: tuple[str, ...]
    elementwise_repeats: int


PRESETS = {
    "quick": Preset(rounds=2, decode_steps=3, dtypes=("bfloat16",), elementwise_repeats=1),
    "full": Preset(
        rounds=5, decode_steps=6, dtypes=("float32", "bfloat16", "float16"), elementwise_repeats=3
    ),
    # hrm validate's full sweep, profiled before each pass: both dtypes it runs, as before
    # --quick was cut (its float32 predictions keep their own figures)
    "pass": Preset(rounds=3, decode_steps=6, dtypes=("float32", "bfloat16"), elementwise_repeats=2),
}
# a fit that does not settle is measured once more, then refused (settled_fit)
ATTEMPTS = 2
# distinct expert weights at most (more experts cycle through these): enough to stream far past
# any last-level cache between two small ops, as a real model does, without a model's memory
EXPERT_BYTES_CAP = 512 * 2**20


def measure_cpu_overhead(
    arch: ModelArch,
    dtype: str,
    *,
    cpu_gemm: CpuGemmChoice,
    elementwise_rate: float,
    preset: Preset = PRESETS["full"],
) -> LaunchOverhead:
    """The fixed costs of the executor's CPU decode in `dtype` (see the module docstring), its
    GEMMs along `cpu_gemm` (the profile's choice: native float16 on a CPU without avx512_fp16
    runs at a few GFLOP/s), its elementwise passes charged at `elementwise_rate` elements/s."""
    dt = getattr(torch, dtype)
    weights = shaped_weights(_layered(arch, max(LAYERS)), dt)  # the fewer layers take the first
    samplers = {}
    for layers in LAYERS:
        first = dataclasses.replace(weights, layers=weights.layers[:layers])
        checkpoint = Checkpoint(
            directory=None, arch=_layered(arch, layers), weights=first, dtype=dt
        )
        model, priced = _timed_model(checkpoint, cpu_gemm)
        for batch in BATCHES:
            samplers[(layers, batch)] = _rest_sampler(
                model, priced, batch, elementwise_rate, preset.decode_steps
            )
    problem = ""
    for _ in range(ATTEMPTS):
        samples: dict[tuple[int, int], list[float]] = {key: [] for key in samplers}
        for _ in range(preset.rounds):
            for key, sample in samplers.items():
                samples[key].append(sample())
        overhead, problem = settled_fit(arch, samples)
        if not problem:
            return overhead
    raise HrmError(
        f"the executor's fixed costs in {dtype} did not settle in {ATTEMPTS} tries of "
        f"{preset.rounds} rounds: {problem}; other processes were likely taking the CPU: "
        "profile again when the host is idle (a longer preset times more rounds)"
    )


def settled_fit(arch: ModelArch, samples) -> tuple[LaunchOverhead, str]:
    """The fit of the rounds' medians with each figure's spread (the range of its fits round by
    round), and why it cannot be trusted ("" when it can): a figure whose rounds disagree by more
    than the whole unpriced time of the configuration it weighs most in is noise, not a cost (a
    loaded 2-core host fitted 48 ms per expert touched, where idle CPUs fit 70-160 us)."""
    medians = {key: statistics.median(values) for key, values in samples.items()}
    fit = _fit(arch, medians)
    rounds = len(next(iter(samples.values())))
    if rounds < 2:
        return LaunchOverhead(**fit), ""
    fits = [_fit(arch, {key: values[r] for key, values in samples.items()}) for r in range(rounds)]
    spread = {name: max(f[name] for f in fits) - min(f[name] for f in fits) for name in fit}
    overhead = LaunchOverhead(**fit, spread=spread)
    few, many = LAYERS
    lo, hi = BATCHES
    weighs = {  # figure -> (its count in a step, the configuration where that count is largest)
        "per_step_s": (1, (few, lo)),
        "per_layer_s": (many, (many, lo)),
        "per_expert_s": (many * expected_distinct_experts(arch, hi), (many, hi)),
    }
    for name, (count, key) in weighs.items():
        if spread[name] * count > max(medians[key], 0.0):
            low, high = min(f[name] for f in fits), max(f[name] for f in fits)
            return overhead, (
                f"{name.removesuffix('_s').replace('_', ' ')} came out {_us(fit[name])} us with "
                f"rounds from {_us(low)} to {_us(high)} us, which x{count:.0f} is more than the "
                f"{_us(medians[key])} us a step left to fit it from"
            )
    return overhead, ""


def _fit(arch: ModelArch, rest: dict) -> dict[str, float]:
    """The module docstring's fit of rest(L, b): per expert touched, then per layer, then per
    step, each at least 0 (what the priced parts took beyond the step is no cost)."""
    few, many = LAYERS
    layer = {b: (rest[(many, b)] - rest[(few, b)]) / (many - few) for b in BATCHES}
    touched = {b: expected_distinct_experts(arch, b) for b in BATCHES}
    lo, hi = BATCHES
    per_expert = max(layer[hi] - layer[lo], 0.0) / (touched[hi] - touched[lo])
    per_layer = max(layer[lo] - touched[lo] * per_expert, 0.0)
    per_step = max(rest[(few, lo)] - few * (per_layer + touched[lo] * per_expert), 0.0)
    return {"per_layer_s": per_layer, "per_expert_s": per_expert, "per_step_s": per_step}


def _us(seconds: float) -> str:
    return f"{1e6 * seconds:.0f}"


def _layered(arch: ModelArch, layers: int) -> ModelArch:
    """The model at `layers` layers, every one sparse and without a shared expert (the fixed
    costs are a routed layer's), running to its length."""
    return dataclasses.replace(
        arch,
        num_layers=layers,
        shared_expert_intermediate_size=0,
        eos_token_ids=(),
        dense_layers=(),
    )


def _timed_model(checkpoint: Checkpoint, cpu_gemm: CpuGemmChoice):
    """(model, priced): the executor's model of `checkpoint`, its GEMM calls and decode-attention
    stages adding their seconds to priced["gemm"] and priced["attention"]."""
    model = MoEModel(checkpoint, cpu_gemm)
    priced = {"gemm": 0.0, "attention": 0.0}
    model.time_stages({"linear": "gemm", "decode_attention": "attention"}, priced)
    return model, priced


def _rest_sampler(model: MoEModel, priced: dict, batch: int, elementwise_rate: float, steps: int):
    """A function that times one decode of `batch` sequences and returns its rest per step (the
    module docstring's rest(L, b))."""
    shaped = model.arch
    dtype = str(model.dtype).removeprefix("torch.")
    elements = sum(
        op.elementwise_elements
        for op in layer_ops(
            shaped,
            batch=batch,
            new_tokens=1,
            context=PROMPT_LEN,
            weight_dtype=dtype,
            kv_dtype=dtype,
        )
        if op.name != "attention"  # its stage is timed, not counted
    )
    charged_s = shaped.num_layers * elements / elementwise_rate
    # distinct last tokens (the embedding's 64 distinct rows): the sequences route apart
    prompts = [[(n + t) % shaped.vocab_size for t in range(PROMPT_LEN)] for n in range(batch)]

    def from_decode(phase: str, _tokens: int) -> None:  # prefill's calls are not the decode's
        if phase == "prefill":
            priced.update(gemm=0.0, attention=0.0)

    generate(model, prompts, 2)  # warm-up: builds the kernels

    def sample() -> float:
        run = generate(model, prompts, steps + 1, on_step=from_decode)
        return (run.decode_s - priced["gemm"] - priced["attention"]) / steps - charged_s

    return sample


def shaped_weights(arch: ModelArch, dtype: torch.dtype) -> ModelWeights:
    """Weights at the model's shapes, each dense tensor its own, the experts cycling through as
    many distinct sets as fit in EXPERT_BYTES_CAP (at least one). Rows of a random block tiled:
    the values do not change a kernel's speed (the router's are random, and the embedding's 64
    distinct rows give the sequences distinct tokens, so routing spreads), and randn of a
    Mixtral-sized model takes longer than the profile should."""
    g = torch.Generator().manual_seed(0)
    h, i = arch.hidden_size, arch.intermediate_size

    def tiled(rows: int, cols: int) -> torch.Tensor:
        block = (torch.randn(min(rows, 64), cols, generator=g) * INIT_STD).to(dtype)
        return block.repeat(-(-rows // block.shape[0]), 1)[:rows].contiguous()

    def random_rows(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * INIT_STD).to(dtype)

    expert_bytes = 3 * h * i * dtype.itemsize
    distinct = max(1, min(arch.num_layers * arch.num_experts, EXPERT_BYTES_CAP // expert_bytes))
    experts = [
        ExpertWeights(w1=tiled(i, h), w3=tiled(i, h), w2=tiled(h, i)) for _ in range(distinct)
    ]
    return assemble_weights(arch, tiled, experts, random_rows, dtype)
