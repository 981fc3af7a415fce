"""Setting: everything fixed while the planner searches one model on one machine and workload."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from hrm.arch import ModelArch
from hrm.errors import HrmError
from hrm.formats import kv_format_problem
from hrm.hardware import HardwareProfile
from hrm.roofline.ops import expert_gemm_shapes
from hrm.rules.cpu_gemm import CpuGemmChoice, choose_cpu_gemm
from hrm.rules.placement import largest_page_bytes
from hrm.workload import Workload
from planner.memory import MemoryTerms, WeightBytes, memory_terms
from planner.memory import placement_vector as vec
from planner.transfers import check_tensor_parallel


@dataclass(frozen=True, kw_only=True)
class Setting:
    """Everything fixed while a search runs: model, machine, workload, schedule, dtypes."""

    arch: ModelArch
    hardware: HardwareProfile
    workload: Workload
    schedule: str = "cgopipe"
    weight_dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    # the CPU's GEMM path by token count (hrm.rules.cpu_gemm); None: chosen from the profile's CPU
    cpu_gemm: CpuGemmChoice | None = None
    # the KV cache is left-padded to the longest prompt (the resident executor's), so decode
    # attends over the padded slots even when prefill packs the prompts
    padded_kv_cache: bool = False
    # the KV cache is continuous batching's pool of blocks (executor/kv_blocks.py): attention
    # first gathers each sequence's rows out of the pool, a read and a write of them
    paged_kv_cache: bool = False
    # tokens of each prompt already in the pool when its prefill runs: a later chunk of a prompt
    # that continuous batching cut across passes attends over them too (planner/passes.py)
    prefill_prefix: float = 0.0
    # the routed FFN's seconds per group of tokens and per whole group, by device role
    # (planner.op_time)
    ffn_memo: dict[str, dict] = field(default_factory=dict, init=False, compare=False, repr=False)
    # one micro-batch's per-layer seconds by its size b (planner.layer_seconds): a search asks
    # for the same b at many points, and each decode step's fewer sequences again
    layer_memo: dict[float, object] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    # one Setting per kind of layer, with its share of the layers (kinds)
    _kinds: list = field(default_factory=list, init=False, compare=False, repr=False)
    _chosen: list = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_tensor_parallel(self.arch, self.hardware)
        problem = kv_format_problem(self.kv_dtype, self.arch.head_dim)
        if problem:
            raise HrmError(f"--kv-dtype: {problem}")

    def kinds(self) -> list[tuple[Setting, float]]:
        """This setting for each kind of layer (ModelArch.layer_kinds), with its share of the
        layers; itself alone when every layer is alike."""
        if not self.arch.dense_layers:
            return [(self, 1.0)]
        if not self._kinds:
            for kind, n in self.arch.layer_kinds():
                self._kinds.append((self.alike(arch=kind), n / self.arch.num_layers))
        return self._kinds

    def alike(self, **changes) -> Setting:
        """This setting with other `changes` (arch: a kind of layer; workload), sharing what
        holds across them: the CPU's GEMM choice, with its memo."""
        setting = dataclasses.replace(self, **changes)
        object.__setattr__(setting, "_chosen", self._chosen)
        return setting

    @property
    def compute_dtype(self) -> str:
        """GEMMs run in the weight dtype, or a compact format's 16-bit float
        (HardwareProfile.compute_dtype)."""
        return self.hardware.compute_dtype(self.weight_dtype)

    @property
    def cpu_gemm_choice(self) -> CpuGemmChoice:
        """The path the executor takes for each CPU GEMM: given (what a run took), else the one
        hrm.rules.cpu_gemm picks from the profile's curves."""
        if self.cpu_gemm is not None:
            return self.cpu_gemm
        if not self._chosen:  # once: it keeps its rates' memo (hrm.rules.cpu_gemm)
            self._chosen.append(choose_cpu_gemm(
                self.hardware.cpu, self.compute_dtype, source=f"profile {self.hardware.name}",
                shape=expert_gemm_shapes(self.arch)[0],
            ))  # fmt: skip
        return self._chosen[0]

    @property
    def steps(self) -> int:
        return self.workload.gen_len

    @property
    def decode_contexts(self) -> np.ndarray:
        """Keys a decode step attends over: S + t for t = 1..G-1 (S the mean, or the max when the
        prompts or the cache are padded)."""
        padded = self.workload.padding or self.padded_kv_cache
        start = self.workload.prompt_len_max if padded else self.workload.prompt_len_mean
        return start + np.arange(1, self.steps, dtype=float)

    @property
    def weights(self) -> WeightBytes:
        return WeightBytes.of(self.arch, self.weight_dtype)

    @property
    def weights_staged(self) -> bool:
        """The streamed weights exceed what the host may pin (`link.pinnable`, judged with every
        layer streamed): they stay pageable and each page goes through a pinned staging ring."""
        link = self.hardware.link
        if link is None or link.pinnable_bytes is None:
            return False
        return self.arch.num_layers * self.weights.stored > link.pinnable_bytes

    def memory(self, batch_size, micro_batch_size: int) -> MemoryTerms:
        """Every buffer at N = batch_size (scalar or array) and mu = micro_batch_size; with staged
        weights also the ring: F_g * 2 * the largest page of a layer streamed whole (pages cut
        at tensor boundaries by hrm.rules.placement, as the executor cuts them)."""
        terms = memory_terms(
            self.arch,
            self.workload,
            batch_size=batch_size,
            micro_batch_size=micro_batch_size,
            weight_dtype=self.weight_dtype,
            kv_dtype=self.kv_dtype,
            gpu_count=max(1, self.hardware.gpu_count),
        )
        if self.weights_staged:
            m = np.ceil(np.asarray(batch_size, dtype=float) / micro_batch_size)
            pages = np.ones_like(m) if self.schedule in ("serial", "overlap") else m
            page = np.vectorize(lambda p: largest_page_bytes(self.arch, self.weight_dtype, int(p)))
            terms.cpu["weight staging"] = 2 * page(pages)[..., None] * vec(ffn=1.0)
        return terms
