"""The tasks of a continuous pass (executor/passes.py): its micro-batches are groups of decodes
or of prompt chunks, each sequence at its own position, over the paged KV pools
(executor/kv_blocks.py). The weight, projection, expert and hidden-state tasks are the static
ones (executor/tasks.py); embedding, attention, the KV copies and the LM head read the group.

Where the layers run on the device and a layer's KV lives in host memory, a group attends on
the device over its rows fetched from the pools (kv_in), and its new rows go back (kv_out); CPU
attention (decodes under a plan that puts attention there) reads and writes the host pools in
place through the D1/D2 staging buffers, as static decode does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from executor import buffers as buf
from executor.buffers import TURNS
from executor.engine import Action, Op, Task
from executor.kv_blocks import KVBlocks, attend
from executor.tasks import MicroBatch, StepState, TaskBuilder, _record_stream


@dataclass
class PassGroup(MicroBatch):
    """One micro-batch of a pass: `phase` "decode" or "prefill", its sequences (request
    indices), and in `packed` (host tensors) each new token's id, position, sequence and place
    among the sequence's new tokens, the pool slots it is written to, each sequence's slots to
    gather [B, S] and the rows that sample."""

    phase: str = "decode"
    seqs: list[int] = field(default_factory=list)
    key_lens: list[int] = field(default_factory=list)  # KV length after the pass, per sequence
    starts: list[int] = field(default_factory=list)  # KV length before the pass
    on: dict = field(default_factory=dict)  # (name, device) -> packed tensor there

    def at(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, device)
        if key not in self.on:
            self.on[key] = self.packed[name].to(device)
        return self.on[key]

    @property
    def tokens(self) -> int:
        return int(self.packed["token_ids"].shape[0])


class PassTaskBuilder(TaskBuilder):
    """TaskBuilder over PassGroups and a KVBlocks, set by the continuous loop."""

    pools: KVBlocks | None = None

    def uses_staging(self, mb: PassGroup) -> bool:
        """CPU attention of an offloaded run's decodes, through D1/D2."""
        return self.offloaded and mb.phase == "decode" and not self.attention_on_device

    def fetches(self, mb: PassGroup, layer: int) -> bool:
        """Device attention over a host layer's rows, fetched and written back."""
        return self.offloaded and self.kv_on_host(layer) and not self.uses_staging(mb)

    def _embed(self, a: Action, st: StepState) -> Task:
        mb = st.micro_batch(a)

        def run():
            embed = self.model.weights.embed
            h = embed[mb.at("token_ids", embed.device)]
            mb.buffers["h"] = h.to(self.device, non_blocking=self.pinned)
            mb.buffers["rotary"] = self.model.rotary(mb.at("positions", self.device))

        nbytes = mb.tokens * self.arch.hidden_size * self.model.dtype.itemsize
        return Task(run, writes=(buf.hidden(mb.index),), nbytes=nbytes if self.offloaded else 0)

    def _attend(self, layer: int, mb: PassGroup, q, keys_rows, values_rows) -> torch.Tensor:
        pools, dev = self.pools, q.device
        keys, values = pools.keys_and_values(keys_rows.permute(0, 2, 1, 3),
                                             values_rows.permute(0, 2, 1, 3))  # fmt: skip
        return attend(
            q, keys, values, mb.at("positions", dev), mb.at("batch_idx", dev),
            mb.at("local_idx", dev), **self.model.attention_terms(layer, dev, decode=True),
        )  # fmt: skip

    def _in_place(self, layer: int, mb: PassGroup, q, k, v) -> torch.Tensor:
        """Write the new rows into the layer's pool, gather the group's rows, attend."""
        pools = self.pools
        pool_k, pool_v = pools.k[layer], pools.v[layer]
        slots = mb.at("write_slots", pool_k.device)
        pool_k[slots], pool_v[slots] = (
            pools.stored(k.to(pool_k.device)),
            pools.stored(v.to(pool_k.device)),
        )
        gather = mb.at("gather_slots", pool_k.device)  # [B, S]
        keys, values = pools.gathered(pool_k, gather, "k"), pools.gathered(pool_v, gather, "v")
        return self._attend(layer, mb, q.to(pool_k.device), keys, values)

    def _attention(self, a: Action, st: StepState) -> Task:
        mb, layer = st.micro_batch(a), a.layer
        j = mb.index
        if self.uses_staging(mb):
            s = st.batch.staging[j % TURNS]

            def run_cpu():
                b = mb.size
                s["out"][:b].copy_(self._in_place(layer, mb, s["q"][:b], s["k"][:b], s["v"][:b]))

            return Task(run_cpu, reads=(buf.stage_in(j),),
                        writes=(buf.stage_out(j), buf.kv(j, layer)))  # fmt: skip
        if self.fetches(mb, layer):

            def run_fetched():
                q, k, v = mb.buffers["qkv"]
                fk, fv = mb.buffers.pop("fetched")  # [B, S, nkv, row] on the device
                new = self.pools.stored(k), self.pools.stored(v)
                bi, pos = mb.at("batch_idx", fk.device), mb.at("positions", fk.device)
                fk[bi, pos], fv[bi, pos] = new
                mb.buffers["attn"] = self._attend(layer, mb, q, fk, fv)
                mb.buffers["kv_new"] = new

            return Task(run_fetched, reads=(buf.qkv(j), buf.kv_device(j)),
                        writes=(buf.attn(j), buf.kv_device(j)))  # fmt: skip

        def run_local():
            q, k, v = mb.buffers["qkv"]
            mb.buffers["attn"] = self._in_place(layer, mb, q, k, v)

        return Task(run_local, reads=(buf.qkv(j),), writes=(buf.attn(j), buf.kv(j, layer)))

    def _kv_in(self, a: Action, st: StepState) -> Task:
        """The group's rows held before this pass, from the host pool to the device."""
        mb, layer = st.micro_batch(a), a.layer
        held = max(mb.starts)
        pools = self.pools

        def run():
            out = []
            for pool in (pools.k[layer], pools.v[layer]):
                B, S = mb.packed["gather_slots"].shape
                fetched = torch.zeros(B, S, *pool.shape[1:], dtype=pool.dtype, device=self.device)
                if held:
                    rows = pool[mb.at("gather_slots", pool.device)[:, :held]]
                    fetched[:, :held].copy_(rows, non_blocking=self.pinned)
                out.append(fetched)
            mb.buffers["fetched"] = tuple(out)

        nbytes = mb.size * held * pools.token_bytes
        return Task(run, reads=(buf.kv(mb.index, layer),), writes=(buf.kv_device(mb.index),),
                    nbytes=nbytes)  # fmt: skip

    def _kv_out(self, a: Action, st: StepState) -> Task:
        """The pass's new rows, from the device into the host pool."""
        mb, layer = st.micro_batch(a), a.layer
        pools = self.pools

        def run():
            k, v = mb.buffers.pop("kv_new")
            for t in (k, v):
                _record_stream(t)
            slots = mb.at("write_slots", pools.k[layer].device)
            pools.k[layer][slots] = k.to(pools.k[layer].device)
            pools.v[layer][slots] = v.to(pools.v[layer].device)

        nbytes = mb.tokens * pools.token_bytes
        return Task(run, reads=(buf.kv_device(mb.index),), writes=(buf.kv(mb.index, layer),),
                    nbytes=nbytes)  # fmt: skip

    def _head(self, a: Action, st: StepState) -> Task:
        """Logits of the rows that sample only: a chunk that does not end its prompt has none."""
        mb = st.micro_batch(a)
        store = self.store

        def run():
            h = mb.buffers.pop("h")
            rows = mb.at("sample_rows", h.device)
            if not rows.numel():
                mb.buffers["logits"] = None
            elif store is None:
                mb.buffers["logits"] = self.model.logits(h[rows])
            else:
                mb.buffers["logits"] = self.model.logits(h[rows], store.final_norm, store.lm_head)
            mb.buffers.pop("rotary", None)

        return Task(run, reads=(buf.hidden(mb.index),), writes=(buf.logits(mb.index),))

    BUILDERS = TaskBuilder.BUILDERS | {
        Op.EMBED: _embed,
        Op.ATTENTION: _attention,
        Op.KV_IN: _kv_in,
        Op.KV_OUT: _kv_out,
        Op.HEAD: _head,
    }
