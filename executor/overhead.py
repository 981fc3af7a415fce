"""The GPU's fixed cost per layer, per expert touched and per step, and what the expert FFN costs
beyond its GEMMs on either device.

Every op the forward runs costs a dispatch on top of its FLOPs and bytes (Python, torch's
dispatcher, the host read of the routing counts). The roofline does not see it; on small
batches it dominates. On a GPU it is the host's time to issue the kernels, measured here by
running the real forward (MoEModel, generate) on a miniature of the model: same layer structure,
experts and top-k, with hidden size 64, so that the arithmetic is negligible and what is left is
the fixed cost:
  step(L, b) = per_step + L * (per_layer + experts_touched(b) * per_expert)
timed at L = 1 and 3 layers and at batch 1 (top-k experts touched) and batch 64 (all of them).
`hrm profile` stores the result (`gpu.launch_overhead`); the planner charges it per layer and
micro-batch. On a CPU the miniature saw a third of the real cost (caches stay warm, kernels act
on tiny rows), so the CPU's is timed at the model's own shapes instead (executor/cpu_overhead.py).

The expert FFN's elementwise passes (gather, SwiGLU gate, scale, scatter) run after its GEMMs,
not under them, at a rate far below the memory bandwidth on a CPU (4.1 G bf16 elements/s at
Mixtral 8x7B's shape against a 28 GB/s stream on an SPR VM). `measure_elementwise_rate` times
the executor's own grouped FFN at a prefill chunk's shape with its GEMMs taken out: elements
read and written per second. On a GPU, `measure_expert_ffn_curve` times the whole grouped FFN
at decode and prefill token counts instead: there the per-expert kernel launches and the host
read of the routing counts, not the element passes, are what the GEMM curve misses.
"""

from __future__ import annotations

import dataclasses

import torch

from executor.checkpoint import (
    INIT_STD,
    Checkpoint,
    ExpertWeights,
    LayerWeights,
    ModelWeights,
    init_kind,
)
from executor.generate import generate
from executor.model import MoEModel
from hrm.arch import ModelArch
from hrm.hardware.parts import LaunchOverhead
from hrm.rules.cpu_gemm import CpuGemmChoice

MINI_HIDDEN = 64
MANY_TOKENS = 64  # a batch that touches every expert (8 of 8 with 2 per token, all but surely)
PROMPT_LEN = 4
DECODE_STEPS = 16
LAYERS = (1, 3)  # the layer counts timed: their difference is two layers' worth


def miniature(arch: ModelArch, layers: int) -> ModelArch:
    """The model's structure (experts, top-k, norms, head grouping) at hidden size 64."""
    group = arch.num_attention_heads // arch.num_key_value_heads
    kv_heads = min(arch.num_key_value_heads, 2)
    heads = dict(num_attention_heads=kv_heads * group, num_key_value_heads=kv_heads,
                 head_dim=MINI_HIDDEN // (kv_heads * group) or 1)  # fmt: skip
    if arch.kv_lora_rank:  # latent attention's own passes, at a latent of 32 and heads of 16
        quarter = MINI_HIDDEN // 4
        heads = dict(num_attention_heads=min(arch.num_attention_heads, 4), head_dim=48,
                     kv_lora_rank=32, rotary_dim=quarter, qk_nope_head_dim=quarter,
                     v_head_dim=quarter, q_lora_rank=arch.q_lora_rank and 2 * quarter)  # fmt: skip
    return dataclasses.replace(
        arch,
        num_layers=layers,
        hidden_size=MINI_HIDDEN,
        intermediate_size=MINI_HIDDEN,
        **heads,
        vocab_size=256,
        shared_expert_intermediate_size=0,
        dense_layers=(),
        eos_token_ids=(),
    )


def random_weights(arch: ModelArch, dtype: torch.dtype, device: str = "cpu") -> ModelWeights:
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * INIT_STD).to(dtype=dtype, device=device)

    h, i = arch.hidden_size, arch.intermediate_size
    experts = [
        ExpertWeights(w1=w(i, h), w3=w(i, h), w2=w(h, i))
        for _ in range(arch.num_layers * arch.num_experts)
    ]
    return assemble_weights(arch, w, experts, w, dtype, device)


def assemble_weights(
    arch: ModelArch,
    dense,
    experts: list[ExpertWeights],
    router,
    dtype: torch.dtype,
    device: str = "cpu",
) -> ModelWeights:
    """A model's weights at `arch`'s shapes: each dense matrix dense(rows, cols), each router
    router(experts, hidden), norms of ones, biases of zeros (the family's dense tensors,
    hrm.rules.placement.dense_shapes), and the layers' experts taking `experts` in turn
    (cycling when there are fewer sets than layers x experts)."""
    from hrm.rules.placement import dense_shapes

    def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        kind = init_kind(name, len(shape))
        if kind != "normal":
            fill = torch.ones if kind == "ones" else torch.zeros
            return fill(shape, dtype=dtype, device=device)
        return router(*shape) if name == "router" else dense(*shape)

    h = arch.hidden_size
    turn = iter(range(arch.num_layers * arch.num_experts))
    layers = tuple(
        LayerWeights(
            **{n: tensor(n, shape) for n, shape in dense_shapes(arch).items()},
            experts=tuple(experts[next(turn) % len(experts)] for _ in range(arch.num_experts)),
        )
        for _ in range(arch.num_layers)
    )
    return ModelWeights(
        embed=dense(arch.vocab_size, h),
        layers=layers,
        final_norm=torch.ones(h, dtype=dtype, device=device),
        lm_head=dense(arch.vocab_size, h),
    )


def _step_seconds(
    arch: ModelArch, layers: int, batch: int, dtype: torch.dtype, repeats: int, device: str
):
    mini = miniature(arch, layers)
    weights = random_weights(mini, dtype, device)
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
    arch: ModelArch, dtype: str = "float32", repeats: int = 9, device: str = "cpu"
) -> LaunchOverhead:
    """The fixed costs of the executor's decode on `device` (see the module docstring). On a
    GPU it is the host's time to issue a layer's kernels: each decode step ends in a host read
    of the sampled tokens, so the host clock around it sees the whole step."""
    dt = getattr(torch, dtype)
    few, many = LAYERS

    def step(layers: int, batch: int) -> float:
        return _step_seconds(arch, layers, batch, dt, repeats, device)

    one = {b: step(few, b) for b in (1, MANY_TOKENS)}
    more = {b: step(many, b) for b in (1, MANY_TOKENS)}
    layer = {b: max(more[b] - one[b], 0.0) / (many - few) for b in one}
    k, e = arch.experts_per_token, arch.num_experts
    per_expert = max(layer[MANY_TOKENS] - layer[1], 0.0) / (e - k) if e > k else 0.0
    return LaunchOverhead(
        per_layer_s=max(layer[1] - k * per_expert, 0.0),
        per_expert_s=per_expert,
        per_step_s=max(one[1] - few * layer[1], 0.0),
    )


GATE_ROWS = 1024  # rows per expert, as a prefill chunk of 8192 tokens gives Mixtral (top-2 of 8)
# the dtypes the executor runs on a CPU: hrm profile measures each one's elementwise rate and
# decode-attention curve
# tokens per grouped FFN call timed on a GPU: decode batches up to a prefill chunk (8192 tokens)
FFN_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 8192)


def _one_layer_model(
    arch: ModelArch, dtype: str, device: str = "cpu", cpu_gemm: CpuGemmChoice | None = None
):
    """(model, its layer's weights, the one-layer arch): the real MoEModel at the model's hidden
    size, width, experts and top-k, its experts sharing one set of weights (what is timed is the
    grouped FFN, not a model's worth of memory), its CPU GEMMs along `cpu_gemm` (default
    native)."""
    layer_arch = dataclasses.replace(
        arch, num_layers=1, vocab_size=256, shared_expert_intermediate_size=0, eos_token_ids=(),
        dense_layers=(),
    )  # fmt: skip
    dt = getattr(torch, dtype)
    one_expert = dataclasses.replace(layer_arch, num_experts=1, experts_per_token=1)
    one = random_weights(one_expert, dt, device)
    router = torch.randn(arch.num_experts, arch.hidden_size, generator=torch.Generator())
    router = router * INIT_STD
    layer = dataclasses.replace(
        one.layers[0],
        router=router.to(dtype=dt, device=device),
        experts=one.layers[0].experts * arch.num_experts,
    )
    weights = dataclasses.replace(one, layers=(layer,))
    checkpoint = Checkpoint(directory=None, arch=layer_arch, weights=weights, dtype=dt)
    if cpu_gemm is None:
        cpu_gemm = CpuGemmChoice(dtype=dtype, buckets=((0.0, "native"),), source="grouped-ffn")
    return MoEModel(checkpoint, cpu_gemm), layer, layer_arch


def _tokens(arch: ModelArch, n: int, dtype: str, device: str) -> torch.Tensor:
    x = torch.randn(n, arch.hidden_size, generator=torch.Generator().manual_seed(0))
    return x.to(dtype=getattr(torch, dtype), device=device)


def measure_elementwise_rate(
    arch: ModelArch, dtype: str, repeats: int = 3, cpu_gemm: CpuGemmChoice | None = None
) -> float:
    """Element passes per second of the executor's grouped expert FFN beyond its GEMMs, on the
    CPU: `_one_layer_model`'s FFN on as many tokens as give each expert about GATE_ROWS rows (a
    prefill chunk), its GEMMs timed apart and taken out, the rest divided into the element passes
    hrm.roofline.ops.expert_ffn_op counts. The median of `repeats`. The GEMMs take `cpu_gemm`'s
    paths (the profile's choice): native float16 on a CPU without avx512_fp16 ran at a few
    GFLOP/s, and these calls then took most of an hour."""
    import statistics
    import time

    from hrm.roofline.ops import expert_ffn_op

    model, layer, layer_arch = _one_layer_model(arch, dtype, cpu_gemm=cpu_gemm)
    tokens = GATE_ROWS * arch.num_experts // arch.experts_per_token
    gemm_s = {"gemm": 0.0}
    model.time_stages({"linear": "gemm"}, gemm_s)
    x = _tokens(layer_arch, tokens, dtype, "cpu")
    rest = []
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first call builds the kernels: not timed
            gemm_s["gemm"] = 0.0
            t0 = time.perf_counter()
            model.experts(layer, x)
            rest.append(time.perf_counter() - t0 - gemm_s["gemm"])
    op = expert_ffn_op(layer_arch, tokens=tokens, weight_dtype=dtype)
    return op.elementwise_elements / max(statistics.median(rest[1:]), 1e-9)


def measure_expert_ffn_curve(
    arch: ModelArch,
    dtype: str,
    device: str,
    *,
    tokens: tuple[int, ...] = FFN_TOKENS,
    min_sample_s: float = 0.2,
    repeats: int = 3,
) -> list[tuple[float, float]]:
    """[(rows per expert, FLOP/s)] of the executor's whole grouped expert FFN (`MoEModel.experts`:
    router, sort, gather, every expert's GEMM chain, scale, scatter, the host read of the routing
    counts) on `device` at each token count: the GPU's per-expert cost as the planner charges it.
    Rows: T*k over the expected experts touched (hrm.roofline.ops.expected_distinct_experts),
    FLOP/s: expert_ffn_op's FLOPs over the median time, so the planner's lookup at those rows
    returns the measured time. Timed by the profile's one loop (hrm.profiling.timing): a warm-up
    call, then `repeats` samples of calls back to back for at least `min_sample_s` each, the
    median."""
    from hrm.profiling.gpu import cuda_event_clock
    from hrm.profiling.timing import perf_counter_clock, time_calls
    from hrm.roofline.ops import expected_distinct_experts, expert_ffn_op

    model, layer, layer_arch = _one_layer_model(arch, dtype, device)
    clock = cuda_event_clock if torch.device(device).type == "cuda" else perf_counter_clock
    points = []
    with torch.inference_mode():
        for n in tokens:
            x = _tokens(layer_arch, n, dtype, device)
            timing = time_calls(
                lambda x=x: model.experts(layer, x),
                clock=clock,
                repeats=repeats,
                min_sample_s=min_sample_s,
            )
            flops = expert_ffn_op(layer_arch, tokens=n, weight_dtype=dtype).flops
            rows = n * arch.experts_per_token / expected_distinct_experts(arch, n)
            points.append((rows, timing.rate(flops)))
    return points
