"""MoE-Lens's stage-1 throughput bound (Yuan, Ma, Talati, arXiv 2504.09345) for a workload and
machine: what continuous batching can reach when every pass streams the weights once.

A sequence of prompt p and generation g holds, on average over its g passes, p + g/2 tokens of
KV, and puts p + g tokens through the model over its life. With M tokens of KV memory, the
passes carry at most PME x M tokens, PME = 2(p + g) / ((2p + g) g), and one pass streams the
weights once, in delta seconds; the GPU's compute caps the rate at T_GPU:
    T_max = min(PME x M / delta, T_GPU)   tokens (prompt and generated) per second,
of which a share g / (p + g) are generated tokens, the rate `hrm plan` reports.

Taken as MoE-Lens defines them: M is the host memory the weights leave (MoE-Lens keeps the KV
cache in host memory) over the KV bytes of a token in every layer; delta is every layer's weights
as stored over the link's host-to-device rate; T_GPU is the GPUs' GEMM FLOP/s at many rows (the
profile's curve, else its sustained, else its peak rate) over 2 FLOPs per active parameter.
docs/planning.md says where our model differs.
"""

from __future__ import annotations

from dataclasses import dataclass

from hrm.arch import ModelArch
from hrm.hardware import HardwareProfile
from hrm.workload import Workload
from planner.memory import WeightBytes, usable_bytes

LARGE_GEMM_ROWS = 4096.0  # T_GPU's GEMM rate: measured at many rows, else sustained, else peak


def pme(prompt_len: float, gen_len: float) -> float:
    """Tokens a sequence puts through passes over its life per token of KV it holds on
    average, per pass: 2(p + g) / ((2p + g) g)."""
    p, g = float(prompt_len), float(gen_len)
    return 2 * (p + g) / ((2 * p + g) * g)


@dataclass(frozen=True, kw_only=True)
class Stage1Bound:
    prompt_len: float  # p
    gen_len: float  # g
    kv_tokens: float  # M
    stream_s: float  # delta
    gpu_tokens_per_s: float  # T_GPU

    @property
    def pme(self) -> float:
        return pme(self.prompt_len, self.gen_len)

    @property
    def memory_tokens_per_s(self) -> float:
        """PME x M / delta: what the KV memory and the link allow."""
        return self.pme * self.kv_tokens / self.stream_s if self.stream_s > 0 else float("inf")

    @property
    def tokens_per_s(self) -> float:
        """T_max, prompt and generated tokens per second."""
        return min(self.memory_tokens_per_s, self.gpu_tokens_per_s)

    @property
    def binds(self) -> str:
        if self.memory_tokens_per_s <= self.gpu_tokens_per_s:
            return "the KV memory and the link"
        return "the GPU's compute"

    @property
    def generated_per_s(self) -> float:
        """T_max's generated tokens per second: comparable with a plan's throughput."""
        return self.tokens_per_s * self.gen_len / (self.prompt_len + self.gen_len)

    def to_dict(self) -> dict:
        return {
            "pme": self.pme,
            "kv_tokens": self.kv_tokens,
            "stream_s": self.stream_s,
            "gpu_tokens_per_s": self.gpu_tokens_per_s,
            "memory_tokens_per_s": self.memory_tokens_per_s,
            "tokens_per_s": self.tokens_per_s,
            "generated_per_s": self.generated_per_s,
            "binds": self.binds,
        }

    def describe(self, plan_generated_per_s: float | None = None) -> str:
        """One line for `hrm plan` and `hrm roofline`."""
        share = (
            f"; this plan reaches {plan_generated_per_s / self.generated_per_s:.0%} of it"
            if plan_generated_per_s is not None and self.generated_per_s > 0
            else ""
        )
        return (
            f"MoE-Lens stage-1 bound: PME {self.pme:.4f}, M {self.kv_tokens:,.0f} KV tokens, "
            f"delta {self.stream_s:.3g} s a pass, T_GPU {self.gpu_tokens_per_s:,.0f} tok/s: "
            f"T_max {self.tokens_per_s:,.0f} tok/s ({self.generated_per_s:,.1f} generated), "
            f"bound by {self.binds}{share}"
        )


def stage1_bound(
    arch: ModelArch, hardware: HardwareProfile, workload: Workload, weight_dtype: str,
    kv_dtype: str,
) -> Stage1Bound:  # fmt: skip
    """The bound for the workload's mean prompt and its generation length on `hardware`."""
    w = WeightBytes.of(arch, weight_dtype)
    host_weights = w.num_layers * w.stored + w.embedding + w.head
    free = max(0.0, usable_bytes(hardware.cpu.total_memory_bytes) - host_weights)
    kv_tokens = free / arch.kv_bytes_per_token(kv_dtype)
    link = hardware.h2d_bytes_per_s
    stream_s = w.num_layers * w.stored / link if link > 0 else 0.0
    gpu = hardware.gpu or hardware.cpu  # a CPU-only machine computes on its CPU
    rate = gpu.matmul_flops_per_s(hardware.compute_dtype(weight_dtype), LARGE_GEMM_ROWS)
    return Stage1Bound(
        prompt_len=workload.prompt_len_mean,
        gen_len=workload.gen_len,
        kv_tokens=kv_tokens,
        stream_s=stream_s,
        gpu_tokens_per_s=rate / (2.0 * arch.active_params),
    )
