"""The planner's prices and buffers for compact weight formats (hrm/formats.py): what the layers
compute in, the compact bytes that stream and stay in host memory, the 16-bit slot, and the
GPU's dequantization at its measured rate."""

from __future__ import annotations

import dataclasses

import pytest

from hrm.arch import resolve_model
from hrm.errors import HrmError
from hrm.formats import bytes_per_weight, kv_format_problem
from hrm.hardware import resolve_hardware
from hrm.hardware.files import _device_from_dict, _device_to_dict
from hrm.policy import Policy
from hrm.rules.placement import place_model, slot_bytes
from hrm.workload import Workload
from planner import predict
from planner.cost import dequantize_seconds
from planner.evaluate import batch_model, component_seconds
from planner.search import search
from planner.setting import Setting

WL = Workload(prompt_len_mean=512, prompt_len_max=512, gen_len=128)


def test_the_compute_dtype_is_the_machines_fast_16_bit_float():
    mixtral = resolve_model("mixtral-8x7b")
    for hardware, half in (("t4", "float16"), ("l4", "bfloat16"), ("ci-cpu-avx512", "bfloat16")):
        setting = Setting(arch=mixtral, hardware=resolve_hardware(hardware), workload=WL,
                          weight_dtype="int4")  # fmt: skip
        assert setting.compute_dtype == half
    assert resolve_hardware("t4").compute_dtype("float32") == "float32"


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_bundled_model_streams_the_formats_bytes(fmt):
    """Mixtral's linear layers all have whole groups: only norms and routers stay 16-bit."""
    mixtral = resolve_model("mixtral-8x7b")
    placed = place_model(mixtral, 0.0, fmt)
    assert placed.stored_ratio == pytest.approx(bytes_per_weight(fmt) / 2, rel=2e-3)
    assert placed.stored_ratio > bytes_per_weight(fmt) / 2  # the 16-bit norms and routers
    half = place_model(mixtral, 0.0, "bfloat16")
    assert placed.layers_bytes == half.layers_bytes  # resident weights: 16-bit on the GPU
    assert slot_bytes(mixtral, fmt) == pytest.approx(
        placed.stored_ratio * slot_bytes(mixtral, "bfloat16")
    )
    assert slot_bytes(mixtral, fmt, stored=False) == slot_bytes(mixtral, "bfloat16")


def test_the_plans_buffers_and_link_bytes_are_compact():
    mixtral, t4 = resolve_model("mixtral-8x7b"), resolve_hardware("t4")
    policies = {
        fmt: Policy(
            batch_size=256,
            micro_batch_size=64,
            attention_on_gpu=False,
            ffn_on_gpu=True,
            weights_gpu_fraction=0.0,
            kv_gpu_fraction=0.0,
            weight_dtype=fmt,
            kv_dtype="float16",
        )  # fmt: skip
        for fmt in ("float16", "int4")
    }
    plans = {fmt: predict(mixtral, t4, WL, p) for fmt, p in policies.items()}
    half, int4 = plans["float16"].memory, plans["int4"].memory
    ratio = place_model(mixtral, 0.0, "int4").stored_ratio
    assert int4.cpu["layer weights"] == pytest.approx(ratio * half.cpu["layer weights"])
    assert int4.gpu["paged buffer"] == pytest.approx(ratio * half.gpu["paged buffer"])
    # one 16-bit slot instead of two: the layer the GPU computes
    assert int4.gpu["dequantized layer"] == pytest.approx(half.gpu["paged buffer"] / 2)
    assert "dequantized layer" not in half.gpu
    busy = {
        fmt: component_seconds(
            batch_model(
                Setting(
                    arch=mixtral, hardware=t4, workload=WL, weight_dtype=fmt, kv_dtype="float16"
                ),
                256,
                64,
            ),
            policies[fmt],
        )  # fmt: skip
        for fmt in policies
    }
    assert busy["int4"]["h2d"]["weights"] == pytest.approx(
        ratio * busy["float16"]["h2d"]["weights"], rel=0.02
    )
    assert busy["float16"]["gpu"]["dequantize"] == 0.0
    # once per layer and step: L * G * (weights of a layer) / rate
    setting = Setting(arch=mixtral, hardware=t4, workload=WL, weight_dtype="int4")
    assert busy["int4"]["gpu"]["dequantize"] == pytest.approx(
        mixtral.num_layers * WL.gen_len * dequantize_seconds(setting)
    )


def test_dequantization_is_priced_at_the_measured_rate_else_by_its_traffic():
    mixtral, l4 = resolve_model("mixtral-8x7b"), resolve_hardware("l4")
    weights = mixtral.layers_params / mixtral.num_layers
    setting = Setting(arch=mixtral, hardware=l4, workload=WL, weight_dtype="int8")
    # int8: codes read (1), written as 16-bit (2), read again (2) and the result written (2)
    assert dequantize_seconds(setting) == pytest.approx(
        weights * 7 / l4.gpu.memory_bandwidth_bytes_per_s
    )
    measured = dataclasses.replace(l4.gpu, dequantize_rates={"int8": 1e11})
    setting = dataclasses.replace(setting, hardware=dataclasses.replace(l4, gpu=measured))
    assert dequantize_seconds(setting) == pytest.approx(weights / 1e11)
    # the rate survives the profile's round trip
    back = _device_from_dict(_device_to_dict(measured), "gpu")
    assert back.dequantize_rates == {"int8": 1e11}


def test_int4_beats_16_bits_for_mixtral_on_a_t4():
    """The link binds a 16-bit Mixtral on a T4; int4 moves 0.28 of its bytes."""
    mixtral, t4 = resolve_model("mixtral-8x7b"), resolve_hardware("t4")
    best = {
        fmt: search(mixtral, t4, WL, weight_dtype=fmt, kv_dtype="float16", top_k=1).best
        for fmt in ("float16", "int4")
    }
    half, int4 = (best[f].predicted.throughput_tok_s for f in ("float16", "int4"))
    assert int4 > 1.5 * half
    assert best["float16"].bottleneck.startswith("h2d")
    assert not best["int4"].bottleneck.startswith("h2d")


def test_a_compact_kv_cache_is_counted_at_its_rows_bytes():
    mixtral, t4 = resolve_model("mixtral-8x7b"), resolve_hardware("t4")
    # a token's K and V of one layer: 8 heads of 128, in 2 groups of 64
    assert mixtral.kv_token_bytes("bfloat16") == 2 * 8 * 128 * 2
    assert mixtral.kv_token_bytes("int8") == 2 * 8 * (128 + 2 * 2 * 2)
    assert mixtral.kv_token_bytes("int4") == 2 * 8 * (64 + 2 * 2 * 2)
    plans = {
        kv: predict(
            mixtral,
            t4,
            WL,
            Policy(
                batch_size=256,
                micro_batch_size=64,
                attention_on_gpu=True,
                ffn_on_gpu=True,
                weights_gpu_fraction=0.0,
                kv_gpu_fraction=0.0,
                weight_dtype="int4",
                kv_dtype=kv,
            ),
        )  # fmt: skip
        for kv in ("float16", "int8", "int4")
    }
    for kv in ("int8", "int4"):
        ratio = mixtral.kv_token_bytes(kv) / mixtral.kv_token_bytes("float16")
        assert plans[kv].memory.cpu["kv cache"] == pytest.approx(
            ratio * plans["float16"].memory.cpu["kv cache"]
        )
        assert plans[kv].memory.gpu["kv prefetch"] == pytest.approx(
            ratio * plans["float16"].memory.gpu["kv prefetch"]
        )


def test_a_head_size_the_kv_groups_do_not_divide_is_refused():
    odd = dataclasses.replace(resolve_model("mixtral-8x7b"), head_dim=96)
    with pytest.raises(HrmError, match="head_dim.*96"):
        Setting(arch=odd, hardware=resolve_hardware("l4"), workload=WL, kv_dtype="int8")
    Setting(arch=odd, hardware=resolve_hardware("l4"), workload=WL, kv_dtype="bfloat16")
    assert kv_format_problem("int4", 16) is None  # one group of 16
    assert kv_format_problem("int4", 18) is not None  # not a multiple of 4
