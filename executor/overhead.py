"""The executor's fixed cost per layer, per expert touched and per step, measured on this host.

Every op the forward runs costs a dispatch on top of its FLOPs and bytes (Python, torch's
dispatcher, the host read of the routing counts). The roofline does not see it; on small
batches it dominates. It is measured here by running the real forward (MoEModel, generate) on
a miniature of the model: same layer structure, experts and top-k, with hidden size 64, so that
the arithmetic is negligible and what is left is the fixed cost:
  step(L, b) = per_step + L * (per_layer + experts_touched(b) * per_expert)
timed at L = 1 and 3 layers and at batch 1 (top-k experts touched) and batch 64 (all of them).
`hrm profile` stores the result (`cpu.launch_overhead`); the planner charges it per layer and
micro-batch.

The expert FFN's elementwise passes (gather, SwiGLU gate, scale, scatter) run after its GEMMs,
not under them, at a rate far below the memory bandwidth on a CPU (4.1 G bf16 elements/s at
Mixtral 8x7B's shape against a 28 GB/s stream on an SPR VM). `measure_elementwise_rate` times
the executor's own grouped FFN at a prefill chunk's shape with its GEMMs taken out: elements
read and written per second.
"""

from __future__ import annotations

import dataclasses

import torch

from executor.checkpoint import Checkpoint, ExpertWeights, LayerWeights, ModelWeights
from executor.generate import generate
from executor.model import MoEModel
from hrm.arch import ModelArch
from hrm.cpu_gemm import CpuGemmChoice
from hrm.hardware_parts import LaunchOverhead

MINI_HIDDEN = 64
MANY_TOKENS = 64  # a batch that touches every expert (8 of 8 with 2 per token, all but surely)
PROMPT_LEN = 4
DECODE_STEPS = 16
LAYERS = (1, 3)  # the layer counts timed: their difference is two layers' worth


def miniature(arch: ModelArch, layers: int) -> ModelArch:
    """The model's structure (experts, top-k, norms, head grouping) at hidden size 64."""
    group = arch.num_attention_heads // arch.num_key_value_heads
    kv_heads = min(arch.num_key_value_heads, 2)
    return dataclasses.replace(
        arch,
        num_layers=layers,
        hidden_size=MINI_HIDDEN,
        intermediate_size=MINI_HIDDEN,
        num_attention_heads=kv_heads * group,
        num_key_value_heads=kv_heads,
        head_dim=MINI_HIDDEN // (kv_heads * group) or 1,
        vocab_size=256,
        shared_expert_intermediate_size=0,
        eos_token_ids=(),
    )


def random_weights(arch: ModelArch, dtype: torch.dtype) -> ModelWeights:
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
    layers = tuple(
        LayerWeights(
            attn_norm=torch.ones(h, dtype=dtype),
            wq=w(q, h),
            wk=w(kv, h),
            wv=w(kv, h),
            wo=w(h, q),
            ffn_norm=torch.ones(h, dtype=dtype),
            router=w(arch.num_experts, h),
            experts=tuple(
                ExpertWeights(w1=w(i, h), w3=w(i, h), w2=w(h, i)) for _ in range(arch.num_experts)
            ),
        )
        for _ in range(arch.num_layers)
    )
    return ModelWeights(
        embed=w(arch.vocab_size, h),
        layers=layers,
        final_norm=torch.ones(h, dtype=dtype),
        lm_head=w(arch.vocab_size, h),
    )


def _step_seconds(arch: ModelArch, layers: int, batch: int, dtype: torch.dtype, repeats: int):
    mini = miniature(arch, layers)
    weights = random_weights(mini, dtype)
    checkpoint = Checkpoint(directory=None, arch=mini, weights=weights, dtype=dtype)
    native = CpuGemmChoice(
        dtype=str(dtype).removeprefix("torch."), buckets=((0.0, "native"),), source="overhead"
    )
    model = MoEModel(checkpoint, native)
    prompts = [[t % mini.vocab_size for t in range(n, n + PROMPT_LEN)] for n in range(batch)]
    generate(model, prompts, 2)  # warm-up
    times = [
        generate(model, prompts, DECODE_STEPS + 1).decode_s / DECODE_STEPS for _ in range(repeats)
    ]
    return min(times)  # a fixed cost: noise only adds to it


def measure_launch_overhead(
    arch: ModelArch, dtype: str = "float32", repeats: int = 9
) -> LaunchOverhead:
    """The fixed costs of the executor's decode on this host (see the module docstring)."""
    dt = getattr(torch, dtype)
    few, many = LAYERS
    one = {b: _step_seconds(arch, few, b, dt, repeats) for b in (1, MANY_TOKENS)}
    more = {b: _step_seconds(arch, many, b, dt, repeats) for b in (1, MANY_TOKENS)}
    layer = {b: max(more[b] - one[b], 0.0) / (many - few) for b in one}
    k, e = arch.experts_per_token, arch.num_experts
    per_expert = max(layer[MANY_TOKENS] - layer[1], 0.0) / (e - k) if e > k else 0.0
    return LaunchOverhead(
        per_layer_s=max(layer[1] - k * per_expert, 0.0),
        per_expert_s=per_expert,
        per_step_s=max(one[1] - few * layer[1], 0.0),
    )


GATE_ROWS = 1024  # rows per expert, as a prefill chunk of 8192 tokens gives Mixtral (top-2 of 8)
ELEMENTWISE_DTYPES = ("float32", "bfloat16", "float16")


def measure_elementwise_rate(arch: ModelArch, dtype: str, repeats: int = 3) -> float:
    """Element passes per second of the executor's grouped expert FFN beyond its GEMMs: the
    real `MoEModel.experts` at the model's hidden size, width, experts and top-k, on as many
    tokens as give each expert about GATE_ROWS rows (a prefill chunk), its GEMMs timed apart and
    taken out, the rest divided into the element passes hrm.ops.expert_ffn_op counts. The
    experts share one set of weights (the GEMMs are not what is measured). The median of
    `repeats`."""
    import statistics
    import time

    from hrm.ops import expert_ffn_op

    layer_arch = dataclasses.replace(
        arch, num_layers=1, vocab_size=256, shared_expert_intermediate_size=0, eos_token_ids=(),
    )  # fmt: skip
    dt = getattr(torch, dtype)
    one = random_weights(dataclasses.replace(layer_arch, num_experts=1, experts_per_token=1), dt)
    router = torch.randn(arch.num_experts, arch.hidden_size, generator=torch.Generator()) * 0.05
    layer = dataclasses.replace(
        one.layers[0], router=router.to(dt), experts=one.layers[0].experts * arch.num_experts
    )
    weights = dataclasses.replace(one, layers=(layer,))
    tokens = GATE_ROWS * arch.num_experts // arch.experts_per_token
    checkpoint = Checkpoint(directory=None, arch=layer_arch, weights=weights, dtype=dt)
    native = CpuGemmChoice(dtype=dtype, buckets=((0.0, "native"),), source="elementwise")
    model = MoEModel(checkpoint, native)
    gemm_s = [0.0]
    linear = model.linear

    def timed_linear(x, w):
        t0 = time.perf_counter()
        out = linear(x, w)
        gemm_s[0] += time.perf_counter() - t0
        return out

    model.linear = timed_linear
    x = torch.randn(tokens, layer_arch.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(dt)
    rest = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first call builds the kernels: not timed
            gemm_s[0] = 0.0
            t0 = time.perf_counter()
            model.experts(weights.layers[0], x)
            rest.append(time.perf_counter() - t0 - gemm_s[0])
    op = expert_ffn_op(layer_arch, tokens=tokens, weight_dtype=dtype)
    return op.elementwise_elements / max(statistics.median(rest[1:]), 1e-9)
