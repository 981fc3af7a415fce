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

import dataclasses
import tempfile
from collections.abc import Sequence

import torch

from executor.buffers import TURNS
from executor.checkpoint import Checkpoint
from executor.engine import Engine, Op
from executor.kv_cache import packed_layout
from executor.model import MoEModel
from executor.pass_tasks import PassTaskBuilder
from executor.pinning import HostPins
from executor.quant import dequantized_weights
from executor.schedules import SCHEDULE_ORDERS, StepShape, dequantize_before_use, read_ahead
from executor.tasks import BatchState, MicroBatch, StepState, TaskBuilder
from executor.weight_store import WeightStore
from hrm.formats import is_compact, row_bytes
from hrm.policy import Policy
from hrm.rules.cpu_gemm import CpuGemmChoice
from hrm.rules.placement import place_model

HOST = torch.device("cpu")


class Runtime:
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
        engine_mode: str | None = None,
        continuous: bool = False,
    ):
        """store None: every weight is used where the model holds it (a resident run, or a plan
        that runs the layers on the CPU); micro_batch_size None: the whole batch is one;
        engine_mode: default executor.engine.engine_mode (HRM_ENGINE); continuous: run passes
        of continuous batching (executor/passes.py) instead of static batches."""
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
        self.continuous = continuous
        self.tasks = (PassTaskBuilder if continuous else TaskBuilder)(
            model,
            store=store,
            device=self.device,
            ffn_on_gpu=self.ffn_on_gpu,
            kv_gpu_layers=self.kv_gpu_layers,
        )
        self.tasks.attention_on_device = self.attention_on_gpu
        queues = {q for _, q in self._all_ops()}
        serial = schedule == "serial" or len(queues) == 1
        self.engine = Engine(self.device, serial=serial, mode=engine_mode)
        self.batch = BatchState(micro_batches=[], staging=[], prefetch=[])
        self.kv_pins = HostPins()

    @property
    def micro_batches(self) -> list[MicroBatch]:
        return self.batch.micro_batches

    # -- the shape of a step -------------------------------------------------------------------

    def chain(self, phase: str, layer: int) -> list[tuple[Op, str]]:
        """What one micro-batch does in `layer` during `phase`, as (op, queue)."""
        home = self.home
        if not self.ffn_on_gpu:
            return [(Op.PRE, home), (Op.ATTENTION, "cpu"), (Op.POST, home)]
        host_kv = self.tasks.kv_on_host(layer)
        if phase == "prefill":
            # a continuous pass's chunk attends over its prompt's rows held so far (kv_in)
            fetch = self.continuous and host_kv and self.offloaded
            ops = [(Op.KV_IN, "h2d")] if fetch else []
            ops += [(Op.PRE, home), (Op.ATTENTION, home)]
            ops += [(Op.KV_OUT, "d2h")] if host_kv else []
            ops += [(Op.POST, home)]
            if self.offloaded:  # hidden states wait in host memory between layers
                ops = ([(Op.HIDDEN_IN, "h2d")] if layer else []) + ops
                ops += [(Op.HIDDEN_OUT, "d2h")] if layer < self.arch.num_layers - 1 else []
            return ops
        if not self.attention_on_gpu:
            return [
                (Op.PRE, home),
                (Op.QKV_OUT, "d2h"),
                (Op.ATTENTION, "cpu"),
                (Op.ATTN_IN, "h2d"),
                (Op.POST, home),
            ]
        if host_kv:
            return [
                (Op.KV_IN, "h2d"),
                (Op.PRE, home),
                (Op.ATTENTION, home),
                (Op.KV_OUT, "d2h"),
                (Op.POST, home),
            ]
        return [(Op.PRE, home), (Op.ATTENTION, home), (Op.POST, home)]

    def _embed_queue(self) -> str:
        return "h2d" if self.offloaded else self.home

    def _all_ops(self) -> list[tuple[Op, str]]:
        ops = [(Op.EMBED, self._embed_queue()), (Op.HEAD, self.home)]
        if self.offloaded and self.store.streams:
            ops.append((Op.LOAD, "h2d"))
            ops += [(Op.DEQUANTIZE, self.home)] if self.store.compact else []
        for phase in ("prefill", "decode"):
            for layer in range(self.arch.num_layers):
                ops += self.chain(phase, layer)
        return ops

    def step_shape(self, step: int, *, last: bool) -> StepShape:
        phase = "prefill" if step == 0 else "decode"
        pages = self.store.page_count if self.offloaded and self.store.streams else 0
        return StepShape(
            step=step,
            num_layers=self.arch.num_layers,
            micro_batches=len(self.micro_batches),
            chain=lambda layer, j: self.chain(phase, layer),
            prologue=[(Op.EMBED, self._embed_queue())],
            epilogue=[(Op.HEAD, self.home)],
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
            home if not self.tasks.kv_on_host(layer) else kv_home
            for layer in range(self.arch.num_layers)
        ]
        streamed_kv = frozenset(
            layer
            for layer in range(self.arch.num_layers)
            if self.offloaded and self.attention_on_gpu and self.tasks.kv_on_host(layer)
        )
        self.kv_pins.close()  # the last batch's caches
        micro_batches = []
        for j, (start, size) in enumerate(zip(starts, sizes, strict=True)):
            group = prompts[start : start + size]
            lens = torch.tensor([len(p) for p in group], device=home)
            padded = int(lens.max())
            cache = self.model.new_cache(
                len(group),
                padded + gen_len,
                device=kv_home,
                layer_devices=layer_devices,
                slot_major=streamed_kv,
            )
            if self.device.type == "cuda":  # pinned, or its copies are staged and synchronous
                self.kv_pins.pin_all(cache.slot_major_tensors())
            cache.start(lens.to(kv_home), padded)
            mb = MicroBatch(index=j, lens=lens, padded_len=padded, cache=cache)
            mb.packed = packed_layout(group, lens, padded, home)
            micro_batches.append(mb)
        max_len = max(mb.cache.max_len for mb in micro_batches)
        self.batch = BatchState(
            micro_batches=micro_batches,
            staging=self._staging(mu),
            prefetch=self._prefetch(mu, max_len),
        )

    def _staging(self, mu: int) -> list[dict[str, torch.Tensor]]:
        """D1/D2 staging (one set per turn, host) for CPU attention of an offloaded run."""
        if not self.offloaded or self.attention_on_gpu:
            return []
        a, dtype, pin = self.arch, self.model.dtype, self.device.type == "cuda"
        nq, nkv, D = a.num_attention_heads, a.num_key_value_heads, a.head_dim

        def host(*shape):
            return torch.empty(shape, dtype=dtype, pin_memory=pin)

        return [
            {"q": host(mu, nq, D), "k": host(mu, nkv, D), "v": host(mu, nkv, a.cached_value_dim)}
            | {"out": host(mu, a.attention_output_size)}
            for _ in range(TURNS)
        ]

    def _prefetch(self, mu: int, max_len: int) -> list[dict[str, torch.Tensor]]:
        """The KV prefetch buffers (one per turn, on the device) for GPU attention over host
        KV: flat, each micro-batch views the front as its own slot-major [S, b, nkv, D]."""
        a = self.arch
        if not (self.offloaded and self.attention_on_gpu and self.kv_gpu_layers < a.num_layers):
            return []
        kv_format, dtype = self.model.kv_format, self.model.dtype
        rows = {"k": a.head_dim, "v": a.cached_value_dim}
        if kv_format is not None:  # the cache's compact rows, prefetched as they are
            dtype = torch.uint8
            rows = {n: row and row_bytes(row, kv_format) for n, row in rows.items()}
        numel = {n: mu * a.num_key_value_heads * max_len * row for n, row in rows.items()}
        return [
            {n: torch.zeros(numel[n], dtype=dtype, device=self.device) for n in "kv"}
            for _ in range(TURNS)
        ]

    # -- steps ---------------------------------------------------------------------------------

    def step(self, step: int, tokens: torch.Tensor | None, *, last: bool) -> torch.Tensor:
        """Prefill (step 0) or one decode step (tokens [B] of the previous step) -> [B, V]."""
        self._run(StepState(step=step, tokens=tokens, batch=self.batch),
                  self.step_shape(step, last=last))  # fmt: skip
        for mb in self.micro_batches:
            if step:
                mb.cache.length += 1
        logits = [mb.buffers.pop("logits") for mb in self.micro_batches]
        # one micro-batch's as it is: a batch-64 step's [64, 32000] fp32 copy took 0.6 ms
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _run(self, state: StepState, shape: StepShape) -> None:
        actions = self.order(shape)
        if shape.pages and self.store.compact:
            actions = dequantize_before_use(actions)
        if shape.pages and self.store.disk is not None:
            actions = read_ahead(actions, self.store.disk.parts.__contains__, shape.num_layers)
        self.engine.run((a, self.tasks.task(a, state)) for a in actions)
        self.engine.synchronize()

    def start_passes(self, pools) -> None:
        """Continuous batching over the KV pools `pools` (executor/kv_blocks.py)."""
        self.tasks.pools = pools
        mu = self.micro_batch_size or 1
        self.batch = BatchState(micro_batches=[], staging=self._staging(mu), prefetch=[])

    def run_pass(self, step: int, groups: list) -> list[torch.Tensor | None]:
        """Pass `step` of continuous batching over its groups (executor/pass_tasks.PassGroup)
        -> each group's logits [samples, V] (None: no row of it samples)."""
        self.batch.micro_batches[:] = groups
        shape = dataclasses.replace(
            self.step_shape(step, last=False),
            chain=lambda layer, j: self.chain(groups[j].phase, layer),
        )
        self._run(StepState(step=step, tokens=None, batch=self.batch), shape)
        return [g.buffers.pop("logits") for g in groups]

    def retire(self, keep: torch.Tensor) -> None:
        """Drop the rows whose sequences stopped (keep [rows], bool, in step order) from their
        micro-batches, and the micro-batches left empty: later steps compute only the rest."""
        kept, start = [], 0
        for mb in self.micro_batches:
            rows = keep[start : start + mb.size]
            start += mb.size
            if rows.all():
                kept.append(mb)
            elif rows.any():
                index = rows.nonzero().flatten()
                mb.lens = mb.lens[index.to(mb.lens.device)]
                mb.cache.keep_rows(index)
                kept.append(mb)
        for j, mb in enumerate(kept):
            mb.index = j
        self.batch.micro_batches[:] = kept

    # -- what the run reports ------------------------------------------------------------------

    def allocated_bytes(self) -> dict[str, dict[str, float]]:
        """Bytes of the buffers this batch holds, by device ("gpu": the device running the
        layers, "cpu": host memory) under the planner's buffer names (planner/memory.py)."""
        out = self.store.allocated_bytes() if self.store is not None else {"gpu": {}, "cpu": {}}

        def size(tensors) -> float:
            return float(sum(t.numel() * t.element_size() for t in tensors))

        kv = {"cpu": 0.0, "gpu": 0.0}
        pools = self.tasks.pools if self.continuous else None
        for layer in range(self.arch.num_layers if pools is not None else 0):
            on_gpu = self.ffn_on_gpu and not self.tasks.kv_on_host(layer)
            kv["gpu" if on_gpu else "cpu"] += size([pools.k[layer], pools.v[layer]])
        for mb in self.micro_batches if pools is None else ():
            for layer in range(self.arch.num_layers):
                on_gpu = self.ffn_on_gpu and not self.tasks.kv_on_host(layer)
                kv["gpu" if on_gpu else "cpu"] += size([mb.cache.k[layer], mb.cache.v[layer]])
        out["gpu"]["kv cache"] = kv["gpu"]
        out["cpu"]["kv cache"] = kv["cpu"]
        out["gpu"]["kv prefetch"] = size(t for b in self.batch.prefetch for t in b.values())
        out["cpu"]["pinned staging"] = size(t for s in self.batch.staging for t in s.values())
        return out

    def close(self) -> None:
        self.engine.close()
        self.kv_pins.close()
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
    take_over: bool = False,
    quiet: bool = True,
    collectives=(None, None),
    continuous: bool = False,
    disk=None,
    cpu_moe: str = "loop",
) -> Runtime:
    """A host-loaded checkpoint placed as `policy` says, on `device` (CUDA, or the CPU standing
    in for a GPU): the weights hrm.rules.placement makes resident copied there, the rest packed into
    host arenas and paged in, m pages per layer under cgopipe and gpu-attention, one whole-layer
    copy under serial and overlap; staged: through a pinned staging ring (the plan's "weight
    staging"); take_over: the store releases the checkpoint's layers as it copies them (a
    checkpoint loaded for this run only). A policy that holds everything on a GPU the weights
    were loaded onto runs them there, with no store: a resident run (Policy.resident). A compact
    weight format (hrm/formats.py) streams its pages compact, and weights that never stream
    are computed with the format's values; quiet: no progress bar while quantizing;
    collectives: a tensor-parallel rank's (reduce, gather) over its group (MoEModel); disk:
    (directory, direct) of the disk tier when the policy keeps weights on disk; cpu_moe: how
    a packed CPU model runs its routed experts (MoEModel)."""
    on_gpu_already = device.type == "cuda" == checkpoint.weights.embed.device.type
    streams = policy.ffn_on_gpu and not (policy.all_on_gpu and on_gpu_already)
    fmt = policy.weight_dtype if is_compact(policy.weight_dtype) else None
    if fmt is not None and not streams:  # computed where they lie: the format's values
        weights = dequantized_weights(checkpoint.weights, fmt)
        checkpoint = dataclasses.replace(checkpoint, weights=weights)
    kv_format = policy.kv_dtype if is_compact(policy.kv_dtype) else None
    model = MoEModel(
        checkpoint, cpu_gemm, device=device if policy.ffn_on_gpu else None, kv_format=kv_format,
        reduce=collectives[0], gather=collectives[1], packs=not streams, take_over=take_over,
        cpu_moe=cpu_moe,
    )  # fmt: skip
    store = None
    if streams:
        placement = place_model(model.arch, policy.weights_gpu_fraction, policy.weight_dtype)
        pages = policy.num_micro_batches if schedule in ("cgopipe", "gpu-attention") else 1
        store = WeightStore(
            checkpoint.weights,
            placement,
            device,
            pages=pages,
            weight_format=fmt,
            staged=staged,
            take_over=take_over,
            quiet=quiet,
            disk=_disk_share(policy, disk, checkpoint.source),
        )
    try:
        return Runtime(
            model,
            schedule=schedule,
            micro_batch_size=policy.micro_batch_size,
            attention_on_gpu=policy.attention_on_gpu,
            kv_gpu_fraction=policy.kv_gpu_fraction,
            store=store,
            device=device,
            continuous=continuous,
        )
    except BaseException:  # the arenas stay pinned until their store is closed
        if store is not None:
            store.close()
        raise


def _disk_share(policy: Policy, disk, sources):
    """(share of each layer's streamed bytes on disk, directory, direct, sources) for
    WeightStore: the plan's r_d of all the weights is r_d / (1 - r_w) of what streams;
    sources: where the checkpoint's tensors lie in its files (Checkpoint.source)."""
    if not policy.weights_disk_fraction:
        return None
    directory, direct = disk if disk is not None else (tempfile.gettempdir(), True)
    streamed = 1.0 - policy.weights_gpu_fraction
    return min(1.0, policy.weights_disk_fraction / streamed), directory, direct, sources
