"""A model placed by a policy, run step by step by the one engine under a schedule.

The runtime turns each action of a schedule (executor/schedules.py) into a task over the
micro-batches' buffers, and hands them to the engine (executor/engine.py). The same code runs a
resident model (everything where its weights are, one micro-batch, executed inline) and an
offloaded plan: layers on the "device" (CUDA, or the CPU standing in for it), weights paged in
from host arenas (executor/weight_store.py), attention on the CPU over a host KV cache or on the
device over KV prefetched from it, and prefill hidden states parked in host memory between layers.

Micro-batch j holds consecutive sequences of the batch with a KV cache of their own, left-padded
to its own longest prompt, so each sequence's numerics equal the same prompt run alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.attention import decode_attention
from executor.checkpoint import Checkpoint
from executor.engine import QUEUES, Action, Engine, Task
from executor.kv_cache import KVCache
from executor.model import MoEModel
from executor.schedules import SCHEDULE_ORDERS, WHOLE_LAYER, StepShape
from executor.weight_store import SLOTS, WeightStore
from hrm.cpu_gemm import CpuGemmChoice
from hrm.placement import PREFILL_CHUNK_TOKENS, place_weights
from hrm.policy import Policy

HOST = torch.device("cpu")


@dataclass
class MicroBatch:
    """One micro-batch's state; the engine's hazards are keyed by (buffer, index)."""

    index: int
    lens: torch.Tensor  # [b] prompt lengths (home device)
    padded_len: int
    cache: KVCache
    packed: dict[str, torch.Tensor] = field(default_factory=dict)  # prefill indices (home)
    buffers: dict[str, Any] = field(default_factory=dict)  # h, q/k/v, attn, logits, ...

    @property
    def size(self) -> int:
        return int(self.lens.shape[0])


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
            mb.packed = _packed(group, lens, padded, home)
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

    def task(self, a: Action) -> Task:
        mb = self.micro_batches[a.micro_batch] if a.op != "load" else None
        return getattr(self, f"_op_{a.op}")(a, mb)

    def _weights(self, layer: int, step: int):
        """The layer's weights for this pass, and the slot keys a task that reads them names."""
        if not self.offloaded:
            return self.model.weights.layers[layer], ()
        slot = (step * self.arch.num_layers + layer) % SLOTS
        keys = tuple(("slot", slot, p) for p in range(len(self.store.pages)))
        return (lambda: self.store.layer(layer, slot)), keys

    def _layer_weights(self, weights):
        return weights() if callable(weights) else weights

    # -- ops (one method per op; each returns the Task) ----------------------------------------

    def _op_load(self, a: Action, _):
        slot = (a.step * self.arch.num_layers + a.layer) % SLOTS
        pages = range(len(self.store.pages)) if a.micro_batch == WHOLE_LAYER else [a.micro_batch]
        nbytes = sum(self.store.page_bytes(p) for p in pages)
        return Task(
            lambda: self.store.copy_page(a.layer, a.micro_batch, slot),
            writes=tuple(("slot", slot, p) for p in pages),
            nbytes=nbytes,
        )

    def _op_embed(self, a: Action, mb: MicroBatch):
        decode = self._step > 0
        tokens, step = self._tokens, self._step

        def run():
            if decode:
                start = sum(m.size for m in self.micro_batches[: mb.index])
                ids = tokens[start : start + mb.size]
                positions = mb.lens + step - 1
            else:
                ids, positions = mb.packed["token_ids"], mb.packed["positions"]
            embed = self.model.weights.embed
            h = embed[ids.to(embed.device)]
            mb.buffers["h"] = h.to(self.device, non_blocking=self.pinned)
            mb.buffers["rotary"] = self.model.rotary(positions.to(self.device))

        nbytes = mb.size * self.arch.hidden_size * self.model.dtype.itemsize
        return Task(run, writes=(("h", mb.index),), nbytes=nbytes if self.offloaded else 0)

    def _op_pre(self, a: Action, mb: MicroBatch):
        weights, keys = self._weights(a.layer, a.step)

        def run():
            w = self._layer_weights(weights)
            cos, sin = mb.buffers["rotary"]
            for t in (mb.buffers["h"], cos, sin):
                _record_stream(t)  # made by the copy queue's stream
            q, k, v = _chunked(
                lambda rows: self.model.pre_attention(
                    w, mb.buffers["h"][rows], cos[rows], sin[rows]
                ),
                mb.buffers["h"].shape[0],
            )
            mb.buffers["qkv"] = (q, k, v)

        return Task(run, reads=(("h", mb.index), *keys), writes=(("qkv", mb.index),))

    def _op_qkv_out(self, a: Action, mb: MicroBatch):
        s = self.staging[mb.index % 2]
        b = mb.size

        def run():
            for name, t in zip("qkv", mb.buffers["qkv"], strict=True):
                _record_stream(t)
                s[name][:b].copy_(t, non_blocking=self.pinned)

        nbytes = sum(s[n][:b].numel() * s[n].element_size() for n in "qkv")
        return Task(
            run, reads=(("qkv", mb.index),), writes=(("stage_in", mb.index % 2),), nbytes=nbytes
        )

    def _op_attention(self, a: Action, mb: MicroBatch):
        layer, j = a.layer, mb.index
        kv = ("kv", j, layer)
        if self._step == 0:
            return self._prefill_attention(layer, mb)
        if self.staging:  # CPU attention over the host cache, through the staging buffers
            s = self.staging[j % 2]

            def run_cpu():
                b = mb.size
                out = self.model.decode_attention(
                    layer, s["q"][:b], s["k"][:b], s["v"][:b], mb.cache
                )
                s["out"][:b].copy_(out)

            return Task(run_cpu, reads=(("stage_in", j % 2),), writes=(("stage_out", j % 2), kv))
        if self._kv_on_host(layer) and self.offloaded:  # GPU attention over prefetched KV
            turn = self._prefetch_slot(a)
            buf = self.prefetch[turn]

            def run_prefetched():
                q, k, v = mb.buffers["qkv"]
                b, end = mb.size, mb.cache.length
                buf["k"][:b, :, end] = k
                buf["v"][:b, :, end] = v
                keys, values = buf["k"][:b, :, : end + 1], buf["v"][:b, :, : end + 1]
                mask = mb.cache.mask(end + 1, self.device)
                mb.buffers["attn"] = decode_attention(q, keys, values, mask)

            return Task(
                run_prefetched,
                reads=(("qkv", j),),
                writes=(("attn", j), ("prefetch", turn)),
            )

        def run_local():
            q, k, v = mb.buffers["qkv"]
            mb.buffers["attn"] = self.model.decode_attention(layer, q, k, v, mb.cache)

        return Task(run_local, reads=(("qkv", j),), writes=(("attn", j), kv))

    def _prefill_attention(self, layer: int, mb: MicroBatch) -> Task:
        """On the device running the layers; a host-cache layer attends over a transient device
        cache of the micro-batch, which kv_out then copies into host memory."""
        host_kv = self.ffn_on_gpu and self._kv_on_host(layer) and self.offloaded
        p = mb.packed

        def run():
            q, k, v = mb.buffers["qkv"]
            if host_kv:
                cache = self.model_cache(mb.size, mb.padded_len, self.device, [self.device])
                cache.start(mb.lens, mb.padded_len)
                attn = self.model.prefill_attention(
                    0, q, k, v, cache, p["batch_idx"], p["slot_idx"]
                )
                mb.buffers["kv_dev"] = (cache.k[0], cache.v[0])
            else:
                attn = self.model.prefill_attention(
                    layer, q, k, v, mb.cache, p["batch_idx"], p["slot_idx"]
                )
            mb.buffers["attn"] = attn

        writes = (("attn", mb.index), ("kv_dev", mb.index) if host_kv else ("kv", mb.index, layer))
        return Task(run, reads=(("qkv", mb.index),), writes=writes)

    def _op_attn_in(self, a: Action, mb: MicroBatch):
        s = self.staging[mb.index % 2]

        def run():
            mb.buffers["attn"] = s["out"][: mb.size].to(self.device, non_blocking=self.pinned)

        nbytes = s["out"][: mb.size].numel() * s["out"].element_size()
        return Task(
            run, reads=(("stage_out", mb.index % 2),), writes=(("attn", mb.index),), nbytes=nbytes
        )

    def _prefetch_slot(self, a: Action) -> int:
        """The prefetch buffer of a (layer, micro-batch) pair: the two alternate in the order the
        pairs' kv_in come in the schedule; the pair's attention and kv_out use the same one."""
        key = (a.layer, a.micro_batch)
        if key not in self._prefetch_turns:
            self._prefetch_turns[key] = len(self._prefetch_turns) % 2
        return self._prefetch_turns[key]

    def _op_kv_in(self, a: Action, mb: MicroBatch):
        turn = self._prefetch_slot(a)
        buf, layer, b = self.prefetch[turn], a.layer, mb.size

        def run():
            end = mb.cache.length
            buf["k"][:b, :, :end].copy_(mb.cache.k[layer][:, :, :end], non_blocking=self.pinned)
            buf["v"][:b, :, :end].copy_(mb.cache.v[layer][:, :, :end], non_blocking=self.pinned)

        end = mb.cache.length
        nbytes = 2 * mb.cache.k[layer][:, :, :end].numel() * self.model.dtype.itemsize
        return Task(
            run, reads=(("kv", mb.index, layer),), writes=(("prefetch", turn),), nbytes=nbytes
        )

    def _op_kv_out(self, a: Action, mb: MicroBatch):
        layer, j = a.layer, mb.index
        cache = mb.cache
        if self._step == 0:  # the prompts' K/V from the transient device cache

            def run_prompt():
                k, v = mb.buffers.pop("kv_dev")
                _record_stream(k)
                _record_stream(v)
                L = mb.padded_len
                cache.k[layer][:, :, :L].copy_(k, non_blocking=self.pinned)
                cache.v[layer][:, :, :L].copy_(v, non_blocking=self.pinned)

            nbytes = 2 * mb.size * mb.padded_len * self.arch.kv_size * self.model.dtype.itemsize
            return Task(
                run_prompt, reads=(("kv_dev", j),), writes=(("kv", j, layer),), nbytes=nbytes
            )
        turn = self._prefetch_slot(a)

        def run_step():  # the new token's K/V, from the prefetch buffer into the host cache
            buf, end, b = self.prefetch[turn], cache.length, mb.size
            cache.k[layer][:, :, end].copy_(buf["k"][:b, :, end], non_blocking=self.pinned)
            cache.v[layer][:, :, end].copy_(buf["v"][:b, :, end], non_blocking=self.pinned)

        nbytes = 2 * mb.size * self.arch.kv_size * self.model.dtype.itemsize
        return Task(
            run_step, reads=(("prefetch", turn),), writes=(("kv", j, layer),), nbytes=nbytes
        )

    def _op_post(self, a: Action, mb: MicroBatch):
        weights, keys = self._weights(a.layer, a.step)

        def run():
            w = self._layer_weights(weights)
            attn, h = mb.buffers.pop("attn"), mb.buffers["h"]
            _record_stream(attn)
            (out,) = _chunked(
                lambda rows: (self.model.post_attention(w, attn[rows], h[rows]),), h.shape[0]
            )
            mb.buffers["h"] = out

        return Task(
            run, reads=(("attn", mb.index), ("h", mb.index), *keys), writes=(("h", mb.index),)
        )

    def _op_hidden_out(self, a: Action, mb: MicroBatch):
        def run():
            h = mb.buffers.pop("h")
            _record_stream(h)
            host = torch.empty(h.shape, dtype=h.dtype, pin_memory=self.pinned)
            mb.buffers["h_host"] = host.copy_(h, non_blocking=self.pinned)

        nbytes = int(mb.lens.sum()) * self.arch.hidden_size * self.model.dtype.itemsize
        return Task(run, reads=(("h", mb.index),), writes=(("h_host", mb.index),), nbytes=nbytes)

    def _op_hidden_in(self, a: Action, mb: MicroBatch):
        def run():
            host = mb.buffers.pop("h_host")
            mb.buffers["h"] = host.to(self.device, non_blocking=self.pinned)

        nbytes = int(mb.lens.sum()) * self.arch.hidden_size * self.model.dtype.itemsize
        return Task(run, reads=(("h_host", mb.index),), writes=(("h", mb.index),), nbytes=nbytes)

    def _op_head(self, a: Action, mb: MicroBatch):
        last = mb.packed["last"] if self._step == 0 else None
        store = self.store

        def run():
            h = mb.buffers.pop("h")
            h = h[last] if last is not None else h
            if store is None:
                mb.buffers["logits"] = self.model.logits(h)
            else:
                mb.buffers["logits"] = self.model.logits(h, store.final_norm, store.lm_head)
            mb.buffers.pop("rotary", None)

        return Task(run, reads=(("h", mb.index),), writes=(("logits", mb.index),))

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


def _packed(group, lens: torch.Tensor, padded: int, device) -> dict[str, torch.Tensor]:
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


def _chunked(fn, rows: int) -> tuple[torch.Tensor, ...]:
    """fn over row ranges of at most PREFILL_CHUNK_TOKENS, results concatenated per output."""
    if rows <= PREFILL_CHUNK_TOKENS:
        return fn(slice(None))
    parts = [fn(slice(i, i + PREFILL_CHUNK_TOKENS)) for i in range(0, rows, PREFILL_CHUNK_TOKENS)]
    return tuple(torch.cat(outs) for outs in zip(*parts, strict=True))


def _record_stream(t: torch.Tensor) -> None:
    """A tensor made on one CUDA stream and used on another is not reused until this one's work
    on it is done."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))


__all__ = ["QUEUES", "Runtime"]
