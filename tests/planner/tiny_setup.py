"""Tiny, round-number models and machines whose costs can be worked out by hand (tests only)."""

from __future__ import annotations

from hrm.arch import ModelArch
from hrm.hardware import HardwareProfile
from hrm.hardware.parts import DeviceSpec, LinkSpec


def tiny_arch(num_layers: int = 2) -> ModelArch:
    # h=64, i=128, 4 query heads and 2 KV heads of 16, 4 experts top-2, vocabulary 100
    return ModelArch(
        name="tiny",
        model_type="mixtral",
        num_layers=num_layers,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        experts_per_token=2,
        vocab_size=100,
    )


def cpu_device(
    *, memory_bytes: float = 2e6, flops: float = 1e10, bandwidth: float = 1e9
) -> DeviceSpec:
    return DeviceSpec(
        name="cpu",
        memory_bytes=memory_bytes,
        memory_bandwidth_bytes_per_s=bandwidth,
        peak_flops_per_s={"float32": flops},
    )


def cpu_only_profile(**kwargs) -> HardwareProfile:
    return HardwareProfile(name="tiny-cpu", source="datasheet", cpu=cpu_device(**kwargs))


def gpu_profile(
    *,
    gpu_memory_bytes: float = 1.5e6,
    cpu_memory_bytes: float = 2e6,
    link_bytes_per_s: float = 1e8,
    gpu_count: int = 1,
) -> HardwareProfile:
    gpu = DeviceSpec(
        name="gpu",
        count=gpu_count,
        memory_bytes=gpu_memory_bytes,
        memory_bandwidth_bytes_per_s=1e11,
        peak_flops_per_s={"float32": 1e12},
    )
    link = LinkSpec(h2d_bytes_per_s=link_bytes_per_s, d2h_bytes_per_s=link_bytes_per_s)
    return HardwareProfile(
        name="tiny-gpu",
        source="datasheet",
        cpu=cpu_device(memory_bytes=cpu_memory_bytes),
        gpu=gpu,
        link=link,
    )
