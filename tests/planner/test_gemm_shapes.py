"""Each CPU GEMM priced at its own shape's measured curve (hrm profile's gemm_shape_curves), and
a CPU standing in for the GPU priced along the CPU's own GEMM paths."""

from __future__ import annotations

import dataclasses

import pytest

from hrm.arch import resolve_model
from hrm.hardware.parts import Curve, gemm_shape_key
from hrm.hardware.stand_in import stand_in_profile
from hrm.roofline.ops import expert_ffn_op, gemm_shapes, layer_ops, lm_head_op
from hrm.rules.cpu_gemm import choose_cpu_gemm
from planner.layer_seconds import micro_batch_seconds
from planner.op_time import op_seconds
from planner.setting import Setting


def flat(rate: float) -> Curve:
    return Curve(points=((1.0, rate), (1e6, rate)))


def test_an_op_splits_its_flops_over_its_gemms_by_shape(arch):
    h, q, kv, i = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    ops = {op.name: op for op in layer_ops(arch, batch=4, new_tokens=1, context=8)}
    qkv = ops["qkv_proj"]
    assert qkv.gemm_shapes == ((h, q), (h, kv), (h, kv))  # three GEMMs, as the executor runs
    assert [f for _, f in qkv.gemm_flops()] == pytest.approx(
        [2 * 4 * h * q, 2 * 4 * h * kv, 2 * 4 * h * kv]
    )
    ffn = expert_ffn_op(arch, tokens=4, weight_dtype="float32")
    assert ffn.gemm_shapes == ((h, i), (h, i), (i, h))  # w1, w3, w2
    assert [f for _, f in ffn.gemm_flops()] == pytest.approx([ffn.flops / 3] * 3)
    assert ffn.scaled(2).gemm_shapes == ffn.gemm_shapes
    assert lm_head_op(arch, batch=4).gemm_shapes == ((h, arch.vocab_size),)
    assert ops["attention"].gemm_shapes == () and ops["norms"].gemm_shapes == ()


def test_the_profiled_shapes_are_every_gemm_of_a_forward_pass():
    mixtral = resolve_model("mixtral-8x7b")
    assert gemm_shapes(mixtral) == (
        (4096, 4096),  # q; o has the same shape
        (4096, 1024),  # k, v
        (4096, 8),  # router
        (4096, 14336),  # w1, w3
        (14336, 4096),  # w2
        (4096, 32000),  # LM head
    )


def test_a_cpu_gemm_is_priced_at_its_own_shapes_curve(arch, make_cpu_profile):
    """T = sum_j FLOPs_j / P_j(rows): q at 5e10, k and v at 2.5e10 FLOP/s (their own curves);
    o has q's shape here (q_size = hidden) and so q's curve; the router's shape has none and
    is read off the nearest measured size (hrm.rules.cpu_gemm.shape_curve); memory never binds
    (1e18 B/s)."""
    h, q, kv = arch.hidden_size, arch.q_size, arch.kv_size
    base = make_cpu_profile(flops=1e11, bandwidth=1e18).cpu
    cpu = dataclasses.replace(
        base,
        matmul_curves={"float32": flat(1e11)},
        gemm_shape_curves={
            gemm_shape_key(h, q): {"float32": flat(5e10)},
            gemm_shape_key(h, kv): {"float32": flat(2.5e10)},
        },
    )
    choice = choose_cpu_gemm(cpu, "float32")
    ops = {op.name: op for op in layer_ops(arch, batch=4, new_tokens=1, context=8)}
    qkv = op_seconds(ops["qkv_proj"], cpu, "float32", 4, cpu_gemm=choice)
    assert qkv == pytest.approx(2 * 4 * h * q / 5e10 + 2 * 2 * 4 * h * kv / 2.5e10)
    assert q == h
    o = op_seconds(ops["o_proj"], cpu, "float32", 4, cpu_gemm=choice)
    assert o == pytest.approx(2 * 4 * q * h / 5e10)
    router = op_seconds(ops["router"], cpu, "float32", 4, cpu_gemm=choice)
    # no curve of its own: below the smallest measured size (k/v's), read flat from it
    assert router == pytest.approx(2 * 4 * h * arch.num_experts / 2.5e10)
    # without a CPU GEMM choice (a GPU), shapes are not looked up: FLOPs / the matmul rate
    assert op_seconds(ops["qkv_proj"], cpu, "float32", 4) == pytest.approx(
        ops["qkv_proj"].flops / 1e11
    )


def test_a_shape_without_a_curve_for_the_path_keeps_w1s_curve_for_it(arch, make_cpu_profile):
    """A shape curve holds some rate keys (float16 is not swept at other shapes): a key it lacks
    is priced at w1's curve of that key."""
    h, q = arch.hidden_size, arch.q_size
    base = make_cpu_profile(flops=1e11, bandwidth=1e18).cpu
    cpu = dataclasses.replace(
        base,
        peak_flops_per_s={"float32": 1e11, "float16": 2e10},
        matmul_curves={"float32": flat(1e11), "float16": flat(2e10)},
        gemm_shape_curves={gemm_shape_key(h, q): {"float32": flat(5e10)}},
    )
    o_like = next(
        op for op in layer_ops(arch, batch=2, new_tokens=1, context=8) if op.name == "o_proj"
    )
    native = choose_cpu_gemm(cpu, "float16", "native")
    assert op_seconds(o_like, cpu, "float16", 2, cpu_gemm=native) == pytest.approx(
        o_like.flops / 2e10
    )


def test_a_stand_in_gpu_takes_the_cpus_gemm_paths(arch, make_cpu_profile, workload):
    """On a CPU-only host the 'GPU' is the CPU and runs the executor's CPU GEMM paths: where
    widened bf16 is 100x native, the stand-in's GEMM parts cost what the CPU's do."""
    hw = make_cpu_profile(flops=1e10, bandwidth=1e18)
    cpu = dataclasses.replace(
        hw.cpu,
        peak_flops_per_s={"float32": 1e10, "bfloat16": 1e8, "bfloat16_widened": 1e10},
        matmul_curves={"bfloat16": flat(1e8), "bfloat16_widened": flat(1e10)},
    )
    stand_in = stand_in_profile(dataclasses.replace(hw, cpu=cpu), gpu_memory_bytes=1e9)
    assert choose_cpu_gemm(stand_in.cpu, "bfloat16").paths == ("widened",)
    mb = micro_batch_seconds(Setting(arch=arch, hardware=stand_in, workload=workload), 2)
    assert mb.gpu_ffn == pytest.approx(mb.cpu_ffn)
    assert mb.gpu_dense == pytest.approx(mb.cpu_dense)
    assert mb.head_gpu == pytest.approx(mb.head_cpu)


def test_a_stand_in_gpu_runs_its_streamed_pages_native(arch, make_cpu_profile, workload):
    """A run whose layers stream packs nothing (a page a store hands over is never reordered for
    oneDNN), so where the CPU's choice is packed the stand-in's GEMMs are priced native and the
    CPU's own packed."""
    hw = make_cpu_profile(flops=1e10, bandwidth=1e18)
    cpu = dataclasses.replace(
        hw.cpu,
        peak_flops_per_s={"float32": 1e10, "bfloat16": 1e8, "bfloat16_widened": 1e8,
                          "bfloat16_packed": 1e10},
        matmul_curves={"bfloat16": flat(1e8), "bfloat16_widened": flat(1e8),
                       "bfloat16_packed": flat(1e10)},
    )  # fmt: skip
    stand_in = stand_in_profile(dataclasses.replace(hw, cpu=cpu), gpu_memory_bytes=1e9)
    choice = choose_cpu_gemm(stand_in.cpu, "bfloat16")
    assert choice.paths == ("packed",) and choice.unpacked().paths == ("native",)
    assert choice.unpacked() is choice.unpacked()  # kept, with its rates' memo
    setting = Setting(arch=arch, hardware=stand_in, workload=workload, weight_dtype="bfloat16")
    mb = micro_batch_seconds(setting, 2)
    assert mb.gpu_ffn[0] == pytest.approx(100 * mb.cpu_ffn[0], rel=0.05)  # GEMM-bound prefill
    assert (mb.gpu_dense > 50 * mb.cpu_dense).all() and mb.head_gpu[0] > 50 * mb.head_cpu[0]
