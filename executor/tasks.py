"""The tasks of the offloading runtime: one builder per op of a schedule's actions.

Each builder turns an action into a Task: the function that does it on this micro-batch's
buffers, the buffers it reads and writes (executor/buffers.py: the engine's hazards), and the
bytes it moves over the link. The TaskBuilder holds what does not change within a run (the
model, the weight store, where the layers run); what a step uses comes in its StepState: the
step, the previous tokens, and the batch's micro-batches, staging and prefetch buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from executor import buffers as buf
from executor.attention import attend_one_step
from executor.buffers import TURNS
from executor.engine import Action, Op, Task
from executor.kv_cache import KVCache
from executor.model import MoEModel
from executor.schedules import WHOLE_LAYER
from executor.weight_store import WeightStore
from hrm.rules.placement import PREFILL_CHUNK_TOKENS


@dataclass
class MicroBatch:
    """One micro-batch's state; the engine's hazards name its buffers by its index."""

    index: int
    lens: torch.Tensor  # [b] prompt lengths (home device)
    padded_len: int
    cache: KVCache
    packed: dict[str, torch.Tensor] = field(default_factory=dict)  # prefill indices (home)
    buffers: dict[str, Any] = field(default_factory=dict)  # h, q/k/v, attn, logits, ...

    @property
    def size(self) -> int:
        return int(self.lens.shape[0])


@dataclass
class BatchState:
    """What one batch holds: its micro-batches, the D1/D2 staging sets (host, CPU attention)
    and the KV prefetch buffers (device, GPU attention over host KV)."""

    micro_batches: list[MicroBatch]
    staging: list[dict[str, torch.Tensor]]
    prefetch: list[dict[str, torch.Tensor]]


@dataclass
class StepState:
    """What one step's tasks share: the step (0 is prefill), the previous step's tokens [B],
    the batch, and which prefetch buffer each (layer, micro-batch) pair took."""

    step: int
    tokens: torch.Tensor | None
    batch: BatchState
    prefetch_turns: dict[tuple[int, int], int] = field(default_factory=dict)

    @property
    def prefill(self) -> bool:
        return self.step == 0

    def micro_batch(self, a: Action) -> MicroBatch:
        return self.batch.micro_batches[a.micro_batch]

    def prefetch_turn(self, a: Action) -> int:
        """The prefetch buffer of a (layer, micro-batch) pair: the two alternate in the order
        the pairs' kv_in come in the schedule; the pair's attention and kv_out use the same."""
        key = (a.layer, a.micro_batch)
        if key not in self.prefetch_turns:
            self.prefetch_turns[key] = len(self.prefetch_turns) % TURNS
        return self.prefetch_turns[key]


class TaskBuilder:
    """Turns (action, step state) into a Task, for a model placed on a device."""

    def __init__(
        self,
        model: MoEModel,
        *,
        store: WeightStore | None,
        device: torch.device,
        ffn_on_gpu: bool,
        kv_gpu_layers: int,
    ):
        """kv_gpu_layers: the first layers, whose KV cache is on the device running the layers
        (the rest is in host memory)."""
        self.model, self.arch, self.store, self.device = model, model.arch, store, device
        self.offloaded = store is not None
        self.ffn_on_gpu = ffn_on_gpu
        self.kv_gpu_layers = kv_gpu_layers
        self.pinned = device.type == "cuda"

    def kv_on_host(self, layer: int) -> bool:
        return layer >= self.kv_gpu_layers

    def task(self, a: Action, state: StepState) -> Task:
        return self.BUILDERS[a.op](self, a, state)

    def _weights(self, layer: int, step: int):
        """The layer's weights for this pass, and the pages a task that reads them names."""
        if not self.offloaded:
            return self.model.weights.layers[layer], ()
        slot = (step * self.arch.num_layers + layer) % TURNS
        if self.store.compact:  # read from the 16-bit slot the layer was dequantized into
            keys = (buf.dequantized(),)
        else:
            keys = tuple(buf.weight_page(slot, p) for p in range(self.store.page_count))
        return (lambda: self.store.layer(layer, slot)), keys

    @staticmethod
    def _layer_weights(weights):
        return weights() if callable(weights) else weights

    # -- weights and embedding -----------------------------------------------------------------

    def _load(self, a: Action, _: StepState) -> Task:
        slot = (a.step * self.arch.num_layers + a.layer) % TURNS
        pages = range(self.store.page_count) if a.page == WHOLE_LAYER else [a.page]
        nbytes = sum(self.store.page_bytes(a.layer, p) for p in pages)
        staged = self.store.reads_disk(a.layer, a.page)  # its disk part: READ's staging
        return Task(
            lambda: self.store.copy_page(a.layer, a.page, slot),
            reads=(buf.disk_stage(slot),) if staged else (),
            writes=tuple(buf.weight_page(slot, p) for p in pages),
            nbytes=nbytes,
        )

    def _read(self, a: Action, _: StepState) -> Task:
        slot = (a.step * self.arch.num_layers + a.layer) % TURNS
        return Task(
            lambda: self.store.read_disk(a.layer, slot),
            writes=(buf.disk_stage(slot),),
            nbytes=self.store.disk_part(a.layer),
        )

    def _dequantize(self, a: Action, _: StepState) -> Task:
        slot = (a.step * self.arch.num_layers + a.layer) % TURNS
        return Task(
            lambda: self.store.dequantize(a.layer, slot),
            reads=tuple(buf.weight_page(slot, p) for p in range(self.store.page_count)),
            writes=(buf.dequantized(),),
        )

    def _embed(self, a: Action, st: StepState) -> Task:
        mb, tokens, step = st.micro_batch(a), st.tokens, st.step

        def run():
            if step:
                start = sum(m.size for m in st.batch.micro_batches[: mb.index])
                ids = tokens[start : start + mb.size]
                positions = mb.lens + step - 1
            else:
                ids, positions = mb.packed["token_ids"], mb.packed["positions"]
            embed = self.model.weights.embed
            h = embed[ids.to(embed.device)]
            mb.buffers["h"] = h.to(self.device, non_blocking=self.pinned)
            mb.buffers["rotary"] = self.model.rotary(positions.to(self.device))

        nbytes = mb.size * self.arch.hidden_size * self.model.dtype.itemsize
        return Task(run, writes=(buf.hidden(mb.index),), nbytes=nbytes if self.offloaded else 0)

    # -- the layer's ops -----------------------------------------------------------------------

    def _pre(self, a: Action, st: StepState) -> Task:
        mb = st.micro_batch(a)
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

        return Task(run, reads=(buf.hidden(mb.index), *keys), writes=(buf.qkv(mb.index),))

    def _qkv_out(self, a: Action, st: StepState) -> Task:
        mb = st.micro_batch(a)
        s, b = st.batch.staging[mb.index % TURNS], mb.size

        def run():
            for name, t in zip("qkv", mb.buffers["qkv"], strict=True):
                _record_stream(t)
                s[name][:b].copy_(t, non_blocking=self.pinned)

        nbytes = sum(s[n][:b].numel() * s[n].element_size() for n in "qkv")
        return Task(
            run, reads=(buf.qkv(mb.index),), writes=(buf.stage_in(mb.index),), nbytes=nbytes
        )

    def _attention(self, a: Action, st: StepState) -> Task:
        mb = st.micro_batch(a)
        layer, j = a.layer, mb.index
        if st.prefill:
            return self._prefill_attention(layer, mb)
        if st.batch.staging:  # CPU attention over the host cache, through the staging buffers
            s = st.batch.staging[j % TURNS]

            def run_cpu():
                b = mb.size
                out = self.model.decode_attention(
                    layer, s["q"][:b], s["k"][:b], s["v"][:b], mb.cache
                )
                s["out"][:b].copy_(out)

            return Task(
                run_cpu, reads=(buf.stage_in(j),), writes=(buf.stage_out(j), buf.kv(j, layer))
            )
        if self.kv_on_host(layer) and self.offloaded:  # GPU attention over prefetched KV
            turn = st.prefetch_turn(a)

            def run_prefetched():
                q, k, v = mb.buffers["qkv"]
                end = mb.cache.length
                cache = mb.cache
                fetched_k, fetched_v = _fetched(st, turn, mb)  # [S, b, nkv, D] (stored rows)
                at, n = cache.position(layer, end), cache.filled(layer, end + 1)
                fetched_k[at], fetched_v[at] = cache.stored(k), cache.stored(v)
                keys, values = cache.keys_and_values(  # [b, nkv, n, D]
                    fetched_k[:n].permute(1, 2, 0, 3), fetched_v[:n].permute(1, 2, 0, 3)
                )
                mask = mb.cache.mask(end + 1, self.device, layer)
                terms = self.model.attention_terms(layer, self.device)
                mb.buffers["attn"] = attend_one_step(q, keys, values, mask, **terms)

            return Task(
                run_prefetched, reads=(buf.qkv(j),), writes=(buf.attn(j), buf.prefetch(turn))
            )

        def run_local():
            q, k, v = mb.buffers["qkv"]
            mb.buffers["attn"] = self.model.decode_attention(layer, q, k, v, mb.cache)

        return Task(run_local, reads=(buf.qkv(j),), writes=(buf.attn(j), buf.kv(j, layer)))

    def _prefill_attention(self, layer: int, mb: MicroBatch) -> Task:
        """On the device running the layers; a host-cache layer attends over a transient device
        cache of the micro-batch, which kv_out then copies into host memory."""
        host_kv = self.ffn_on_gpu and self.kv_on_host(layer) and self.offloaded
        p = mb.packed

        def run():
            q, k, v = mb.buffers["qkv"]
            if host_kv:
                cache = self.model.new_cache(
                    mb.size, mb.padded_len, device=self.device, layer_devices=[self.device],
                    windowed=False,
                )  # fmt: skip
                cache.start(mb.lens, mb.padded_len)
                attn = self.model.prefill_attention(
                    layer, q, k, v, cache, p["batch_idx"], p["slot_idx"], cache_layer=0
                )
                mb.buffers["kv_device"] = (cache.k[0], cache.v[0])
            else:
                attn = self.model.prefill_attention(
                    layer, q, k, v, mb.cache, p["batch_idx"], p["slot_idx"]
                )
            mb.buffers["attn"] = attn

        j = mb.index
        writes = (buf.attn(j), buf.kv_device(j) if host_kv else buf.kv(j, layer))
        return Task(run, reads=(buf.qkv(j),), writes=writes)

    def _attn_in(self, a: Action, st: StepState) -> Task:
        mb = st.micro_batch(a)
        s = st.batch.staging[mb.index % TURNS]

        def run():
            mb.buffers["attn"] = s["out"][: mb.size].to(self.device, non_blocking=self.pinned)

        nbytes = s["out"][: mb.size].numel() * s["out"].element_size()
        return Task(
            run, reads=(buf.stage_out(mb.index),), writes=(buf.attn(mb.index),), nbytes=nbytes
        )

    def _kv_in(self, a: Action, st: StepState) -> Task:
        """The host cache's filled slots into a prefetch buffer: one contiguous copy each of K
        and V (the host layer is slot-major and pinned on CUDA)."""
        mb = st.micro_batch(a)
        turn, layer = st.prefetch_turn(a), a.layer

        def run():
            n = mb.cache.filled(layer, mb.cache.length)
            for fetched, host in zip(_fetched(st, turn, mb), mb.cache.slots[layer], strict=True):
                fetched[:n].copy_(host[:n], non_blocking=self.pinned)

        n = mb.cache.filled(layer, mb.cache.length)
        nbytes = mb.size * n * mb.cache.token_bytes
        return Task(
            run, reads=(buf.kv(mb.index, layer),), writes=(buf.prefetch(turn),), nbytes=nbytes
        )

    def _kv_out(self, a: Action, st: StepState) -> Task:
        mb = st.micro_batch(a)
        layer, j, cache = a.layer, mb.index, mb.cache
        if st.prefill:  # the prompts' K/V from the transient device cache

            def run_prompt():
                device_kv = mb.buffers.pop("kv_device")  # K and V [b, nkv, L, D]
                for t in device_kv:
                    _record_stream(t)
                cache.write_prompt_slots(layer, *device_kv, non_blocking=self.pinned)

            nbytes = mb.size * cache.filled(layer, mb.padded_len) * cache.token_bytes
            return Task(
                run_prompt, reads=(buf.kv_device(j),), writes=(buf.kv(j, layer),), nbytes=nbytes
            )
        turn = st.prefetch_turn(a)

        def run_step():  # the new token's K/V, from the prefetch buffer into the host cache
            at = cache.position(layer, cache.length)
            for fetched, host in zip(_fetched(st, turn, mb), cache.slots[layer], strict=True):
                host[at].copy_(fetched[at], non_blocking=self.pinned)

        nbytes = mb.size * cache.token_bytes
        return Task(
            run_step, reads=(buf.prefetch(turn),), writes=(buf.kv(j, layer),), nbytes=nbytes
        )

    def _post(self, a: Action, st: StepState) -> Task:
        mb = st.micro_batch(a)
        weights, keys = self._weights(a.layer, a.step)

        def run():
            w = self._layer_weights(weights)
            attn, h = mb.buffers.pop("attn"), mb.buffers["h"]
            _record_stream(attn)
            (out,) = _chunked(
                lambda rows: (self.model.post_attention(w, attn[rows], h[rows]),), h.shape[0]
            )
            mb.buffers["h"] = out

        j = mb.index
        return Task(run, reads=(buf.attn(j), buf.hidden(j), *keys), writes=(buf.hidden(j),))

    # -- prefill's hidden states between layers, and the LM head ------------------------------

    def _hidden_out(self, a: Action, st: StepState) -> Task:
        mb = st.micro_batch(a)

        def run():
            h = mb.buffers.pop("h")
            _record_stream(h)
            host = torch.empty(h.shape, dtype=h.dtype, pin_memory=self.pinned)
            mb.buffers["h_host"] = host.copy_(h, non_blocking=self.pinned)

        nbytes = int(mb.lens.sum()) * self.arch.hidden_size * self.model.dtype.itemsize
        j = mb.index
        return Task(run, reads=(buf.hidden(j),), writes=(buf.hidden_host(j),), nbytes=nbytes)

    def _hidden_in(self, a: Action, st: StepState) -> Task:
        mb = st.micro_batch(a)

        def run():
            host = mb.buffers.pop("h_host")
            mb.buffers["h"] = host.to(self.device, non_blocking=self.pinned)

        nbytes = int(mb.lens.sum()) * self.arch.hidden_size * self.model.dtype.itemsize
        j = mb.index
        return Task(run, reads=(buf.hidden_host(j),), writes=(buf.hidden(j),), nbytes=nbytes)

    def _head(self, a: Action, st: StepState) -> Task:
        mb = st.micro_batch(a)
        last = mb.packed["last"] if st.prefill else None
        store = self.store

        def run():
            h = mb.buffers.pop("h")
            h = h[last] if last is not None else h
            if store is None:
                mb.buffers["logits"] = self.model.logits(h)
            else:
                mb.buffers["logits"] = self.model.logits(h, store.final_norm, store.lm_head)
            mb.buffers.pop("rotary", None)

        return Task(run, reads=(buf.hidden(mb.index),), writes=(buf.logits(mb.index),))

    BUILDERS: ClassVar[dict[Op, Callable[[TaskBuilder, Action, StepState], Task]]] = {
        Op.READ: _read,
        Op.LOAD: _load,
        Op.DEQUANTIZE: _dequantize,
        Op.EMBED: _embed,
        Op.PRE: _pre,
        Op.QKV_OUT: _qkv_out,
        Op.ATTENTION: _attention,
        Op.ATTN_IN: _attn_in,
        Op.KV_IN: _kv_in,
        Op.KV_OUT: _kv_out,
        Op.POST: _post,
        Op.HIDDEN_OUT: _hidden_out,
        Op.HIDDEN_IN: _hidden_in,
        Op.HEAD: _head,
    }


assert set(TaskBuilder.BUILDERS) == set(Op)


def _fetched(st: StepState, turn: int, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's slot-major K and V [S, b, nkv, D] in a prefetch buffer's front (rows as
    the cache stores them: latent attention's V has none)."""
    cache, flat = mb.cache, st.batch.prefetch[turn]
    out = []
    for n, rows in zip("kv", (cache.k[0], cache.v[0]), strict=True):
        shape = (cache.max_len, mb.size, rows.shape[1], rows.shape[3])
        out.append(flat[n][: math.prod(shape)].view(shape))
    return out[0], out[1]


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
