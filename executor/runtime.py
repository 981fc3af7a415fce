"""A model placed by a policy, run step by step by the one engine under a schedule.

The runtime turns each action of a schedule (executor/schedules.py) into a task over the
micro-batches' buffers (executor/tasks.py), and hands them to the engine (executor/engine.py).
The same code runs a resident model (everything where its weights are, one micro-batch,
executed inline) and an offloaded plan: layers on the "device" (CUDA, or the CPU standing in for
it), weights paged in from host arenas (executor/weight_store.py), attention on the CPU over a
host KV cache or on the device over KV prefetched from it, and prefill hidden states parked in
host memory between layers.

Micro-batch j holds consecutive sequences of the batch with a KV cache of their own, left-padded
to its own longest prompt, so each sequence's numerics equal the same prompt run alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from executor.checkpoint import Checkpoint
from executor.engine import Engine
from executor.kv_cache import KVCache
from executor.model import MoEModel
from executor.schedules import SCHEDULE_ORDERS, StepShape
from executor.tasks import MicroBatch, TaskBuilder
from executor.weight_store import WeightStore
from hrm.cpu_gemm import CpuGemmChoice
from hrm.placement import place_weights
from hrm.policy import Policy

HOST = torch.device("cpu")


class Runtime(TaskBuilder):
    """Runs prefill and decode steps of one batch at a time under a placement and schedule."""

    def __init__(
        self,
        model: MoEModel,
        *,
        schedule: str,
        micro_batch_size: int | None,
        attention_on_gpu: bool,
        kv_gpu_fraction: float = 0.0,
        store: WeightStore | None = None,
        device: torch.device | None = None,
    ):
        """store None: every weight is used where the model holds it (a resident run, or a plan
        that runs the layers on the CPU); micro_batch_size None: the whole batch is one."""
        self.model, self.arch = model, model.arch
        self.store = store
        self.device = device if store is not None else model.device  # where the layers run
        self.offloaded = store is not None
        self.ffn_on_gpu = self.offloaded or self.device.type != "cpu"
        self.attention_on_gpu = attention_on_gpu and self.ffn_on_gpu
        self.kv_gpu_layers = (
            round(kv_gpu_fraction * self.arch.num_layers) if self.attention_on_gpu else 0
        )
        if not self.offloaded and self.ffn_on_gpu:
            self.kv_gpu_layers = self.arch.num_layers  # a resident GPU run keeps all of it there
        self.schedule = schedule
        self.order = SCHEDULE_ORDERS[schedule]
        self.micro_batch_size = micro_batch_size
        self.home = "gpu" if self.ffn_on_gpu else "cpu"
        queues = {q for q, _ in self._all_ops()}
        self.engine = Engine(self.device, inline=schedule == "serial" or len(queues) == 1)
        self.micro_batches: list[MicroBatch] = []
        self.staging: list[dict[str, torch.Tensor]] = []
        self.prefetch: list[dict[str, torch.Tensor]] = []
        self.pinned = self.device.type == "cuda"

    # -- the shape of a step -------------------------------------------------------------------

    def _kv_on_host(self, layer: int) -> bool:
        return layer >= self.kv_gpu_layers

    def chain(self, phase: str, layer: int) -> list[tuple[str, str]]:
        """What one micro-batch does in `layer` during `phase`, as (op, queue)."""
        home = self.home
        if not self.ffn_on_gpu:
            return [("pre", home), ("attention", "cpu"), ("post", home)]
        host_kv = self._kv_on_host(layer)
        if phase == "prefill":
            ops = [("pre", home), ("attention", home)]
            ops += [("kv_out", "d2h")] if host_kv else []
            ops += [("post", home)]
            if self.offloaded:  # hidden states wait in host memory between layers
                ops = ([("hidden_in", "h2d")] if layer else []) + ops
                ops += [("hidden_out", "d2h")] if layer < self.arch.num_layers - 1 else []
            return ops
        if not self.attention_on_gpu:
            return [
                ("pre", home),
                ("qkv_out", "d2h"),
                ("attention", "cpu"),
                ("attn_in", "h2d"),
                ("post", home),
            ]
        if host_kv:
            return [("kv_in", "h2d"), ("pre", home), ("attention", home), ("kv_out", "d2h")] + [
                ("post", home)
            ]
        return [("pre", home), ("attention", home), ("post", home)]

    def _all_ops(self):
        ops = [("embed", "h2d" if self.offloaded else self.home), ("head", self.home)]
        if self.offloaded and self.store.streams:
            ops.append(("load", "h2d"))
        for phase in ("prefill", "decode"):
            for layer in range(self.arch.num_layers):
                ops += self.chain(phase, layer)
        return ops

    def step_shape(self, step: int, *, last: bool) -> StepShape:
        phase = "prefill" if step == 0 else "decode"
        pages = len(self.store.pages) if self.offloaded and self.store.streams else 0
        return StepShape(
            step=step,
            num_layers=self.arch.num_layers,
            micro_batches=len(self.micro_batches),
            chain=lambda layer: self.chain(phase, layer),
            prologue=[("embed", "h2d" if self.offloaded else self.home)],
            epilogue=[("head", self.home)],
            pages=pages,
            load_first=step == 0 or self.schedule == "serial",
            load_next_step=not last and self.schedule != "serial",
        )

    # -- a batch -------------------------------------------------------------------------------

    def start_batch(self, prompts, gen_len: int, sizes: Sequence[int] | None = None) -> None:
        """Cut the batch into micro-batches (of `sizes`, default mu each) with their KV caches
        and buffers."""
        mu = self.micro_batch_size or len(prompts)
        sizes = (
            list(sizes)
            if sizes
            else [min(mu, len(prompts) - s) for s in range(0, len(prompts), mu)]
        )
        if sum(sizes) != len(prompts) or max(sizes) > mu:
            raise ValueError(f"micro-batch sizes {sizes} do not cut {len(prompts)} prompts by {mu}")
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        home = self.device
        kv_home = HOST if self.offloaded else home
        layer_devices = [
            home if not self._kv_on_host(layer) else kv_home
            for layer in range(self.arch.num_layers)
        ]
        self.micro_batches = []
        for j, (start, size) in enumerate(zip(starts, sizes, strict=True)):
            group = prompts[start : start + size]
            lens = torch.tensor([len(p) for p in group], device=home)
            padded = int(lens.max())
            cache = self.model_cache(len(group), padded + gen_len, kv_home, layer_devices)
            cache.start(lens.to(kv_home), padded)
            mb = MicroBatch(index=j, lens=lens, padded_len=padded, cache=cache)
            mb.packed = packed_layout(group, lens, padded, home)
            self.micro_batches.append(mb)
        self._allocate_staging(mu, max(mb.cache.max_len for mb in self.micro_batches))

    def model_cache(self, batch: int, max_len: int, device, layer_devices) -> KVCache:
        a = self.arch
        return KVCache(
            num_layers=len(layer_devices),
            batch_size=batch,
            kv_heads=a.num_key_value_heads,
            max_len=max_len,
            head_dim=a.head_dim,
            dtype=self.model.dtype,
            device=device,
            layer_devices=layer_devices,
        )

    def _allocate_staging(self, mu: int, max_len: int) -> None:
        """D1/D2 staging (two sets, host) for CPU attention; the KV prefetch buffers (two, on the
        device) for GPU attention over host KV."""
        a, dtype = self.arch, self.model.dtype
        nq, nkv, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.staging, self.prefetch = [], []
        if self.offloaded and not self.attention_on_gpu:
            pin = self.pinned

            def host(*shape):
                return torch.empty(shape, dtype=dtype, pin_memory=pin)

            self.staging = [
                {"q": host(mu, nq, D), "k": host(mu, nkv, D), "v": host(mu, nkv, D)}
                | {"out": host(mu, nq * D)}
                for _ in range(2)
            ]
        if self.offloaded and self.attention_on_gpu and self.kv_gpu_layers < a.num_layers:
            shape = (mu, nkv, max_len, D)
            self.prefetch = [
                {n: torch.zeros(shape, dtype=dtype, device=self.device) for n in ("k", "v")}
                for _ in range(2)
            ]

    # -- steps ---------------------------------------------------------------------------------

    def step(self, step: int, tokens: torch.Tensor | None, *, last: bool) -> torch.Tensor:
        """Prefill (step 0) or one decode step (tokens [B] of the previous step) -> [B, V]."""
        self._step, self._tokens, self._prefetch_turns = step, tokens, {}
        actions = self.order(self.step_shape(step, last=last))
        self.engine.run((a, self.task(a)) for a in actions)
        self.engine.synchronize()
        for mb in self.micro_batches:
            if step:
                mb.cache.length += 1
        return torch.cat([mb.buffers.pop("logits") for mb in self.micro_batches])

    # -- what the run reports ------------------------------------------------------------------

    def allocated_bytes(self) -> dict[str, dict[str, float]]:
        """Bytes of the buffers this batch holds, by device ("gpu": the device running the
        layers, "cpu": host memory) under the planner's buffer names (planner/memory.py)."""
        out = self.store.allocated_bytes() if self.store is not None else {"gpu": {}, "cpu": {}}

        def size(tensors) -> float:
            return float(sum(t.numel() * t.element_size() for t in tensors))

        kv = {"cpu": 0.0, "gpu": 0.0}
        for mb in self.micro_batches:
            for layer in range(self.arch.num_layers):
                on_gpu = self.ffn_on_gpu and not self._kv_on_host(layer)
                kv["gpu" if on_gpu else "cpu"] += size([mb.cache.k[layer], mb.cache.v[layer]])
        out["gpu"]["kv cache"] = kv["gpu"]
        out["cpu"]["kv cache"] = kv["cpu"]
        out["gpu"]["kv prefetch"] = size(t for b in self.prefetch for t in b.values())
        out["cpu"]["pinned staging"] = size(t for s in self.staging for t in s.values())
        return out

    def close(self) -> None:
        self.engine.close()
        if self.store is not None:
            self.store.close()


def placed_runtime(
    checkpoint: Checkpoint,
    policy: Policy,
    schedule: str,
    device: torch.device,
    cpu_gemm: CpuGemmChoice | None = None,
    *,
    staged: bool = False,
) -> Runtime:
    """A host-loaded checkpoint placed as `policy` says, on `device` (CUDA, or the CPU standing
    in for a GPU): the weights hrm.placement makes resident copied there, the rest packed into
    host arenas and paged in, m pages per layer under cgopipe and gpu-attention, one whole-layer
    copy under serial and overlap; staged: through a pinned staging ring (the plan's "weight
    staging")."""
    model = MoEModel(checkpoint, cpu_gemm)
    store = None
    if policy.ffn_on_gpu:
        placement = place_weights(model.arch, policy.weights_gpu_fraction, policy.weight_dtype)
        pages = policy.num_micro_batches if schedule in ("cgopipe", "gpu-attention") else 1
        store = WeightStore(
            checkpoint.weights, model.arch, placement, device, pages=pages, staged=staged
        )
    return Runtime(
        model,
        schedule=schedule,
        micro_batch_size=policy.micro_batch_size,
        attention_on_gpu=policy.attention_on_gpu,
        kv_gpu_fraction=policy.kv_gpu_fraction,
        store=store,
        device=device,
    )


def packed_layout(group, lens: torch.Tensor, padded: int, device) -> dict[str, torch.Tensor]:
    """Packed prompt layout of a micro-batch: token t is (sequence batch_idx, slot slot_idx)."""
    token_ids = torch.tensor([t for p in group for t in p], device=device)
    b = len(group)
    batch_idx = torch.repeat_interleave(torch.arange(b, device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    positions = torch.arange(token_ids.shape[0], device=device) - starts[batch_idx]
    return {
        "token_ids": token_ids,
        "batch_idx": batch_idx,
        "slot_idx": positions + (padded - lens)[batch_idx],
        "positions": positions,
        "last": starts + lens - 1,
    }
