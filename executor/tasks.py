"""The tasks of the offloading runtime: one builder per op of a schedule's actions.

Each `_op_<name>` turns an action into a Task: the function that does it on this micro-batch's
buffers, the buffers it reads and writes (the engine's hazards, executor/engine.py), and the
bytes it moves over the link. The Runtime (executor/runtime.py) holds the state they use: the
model, the weight store, the micro-batches, the staging and prefetch buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from executor.attention import decode_attention
from executor.engine import Action, Task
from executor.kv_cache import KVCache
from executor.schedules import WHOLE_LAYER
from executor.weight_store import SLOTS
from hrm.placement import PREFILL_CHUNK_TOKENS


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


class TaskBuilder:
    """The op -> Task half of the Runtime (attributes set by Runtime.__init__)."""

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
