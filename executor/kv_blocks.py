"""KV memory by what it holds: every layer's K and V in blocks of BLOCK_TOKENS tokens, with a
block table per sequence (as vLLM pages it), for continuous batching (executor/passes.py).

A layer's pool is [blocks * BLOCK_TOKENS, nkv, row] on the device that keeps that layer's KV
(host memory, or the device running the layers for the first kv_gpu_layers); a sequence's
token t of every layer is at slot table[t // BLOCK_TOKENS] * BLOCK_TOKENS + t % BLOCK_TOKENS.
Blocks are taken from the free list as a sequence's tokens are written and all return when it
ends; hrm.rules.admission reserved them, so taking one never fails in a run.

Attention (`attend`) gathers a group's rows into [B, nkv, S, D] (no left padding: sequence b's
token t at slot t) and runs each new query against the keys at or before its position, which
is decode (one query a sequence) and chunked prefill (a chunk after its cached prefix) alike.
A compact KV format's rows are stored as codes and scales and dequantized when gathered;
latent attention's values are its keys' first columns (nothing stored for V).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from executor.attention import attend_one_step, eager_sink_attention
from executor.kv_cache import StoredRows
from hrm.formats import row_bytes
from hrm.rules.admission import BLOCK_TOKENS


class KVBlocks(StoredRows):
    """The pools of every layer and the block tables of the running sequences."""

    def __init__(self, arch, *, blocks: int, dtype: torch.dtype, layer_devices, kv_format=None):
        self.arch, self.dtype, self.format = arch, dtype, kv_format
        self.head_dim, self.value_dim = arch.head_dim, arch.kv_lora_rank or None
        row, store_dtype = arch.head_dim, dtype
        if kv_format is not None:
            row, store_dtype = row_bytes(arch.head_dim, kv_format), torch.uint8
        v_row = 0 if self.value_dim else row
        slots, nkv = blocks * BLOCK_TOKENS, arch.num_key_value_heads
        # zeros: a gathered slot past a sequence's end is masked, but 0 * NaN would still poison
        self.k = [torch.zeros(slots, nkv, row, dtype=store_dtype, device=d) for d in layer_devices]
        self.v = [
            torch.zeros(slots, nkv, v_row, dtype=store_dtype, device=d) for d in layer_devices
        ]
        self.blocks = blocks
        self.free = list(range(blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.owned = bytearray(blocks)  # 1 while a sequence's table holds the block
        self.tables: dict[int, list[int]] = {}
        self.peak_held = 0
        self.token_bytes = nkv * (row + v_row) * store_dtype.itemsize  # K and V, a token, a layer
        self._scratch: dict[tuple, torch.Tensor] = {}  # gathered rows (see gathered)

    @property
    def held(self) -> int:
        return self.blocks - len(self.free)

    def grow(self, seq: int, tokens: int) -> None:
        """Blocks for sequence `seq`'s first `tokens` tokens."""
        table = self.tables.setdefault(seq, [])
        need = -(-tokens // BLOCK_TOKENS) - len(table)
        if need > len(self.free):
            raise RuntimeError(f"KV blocks over-committed: {need} wanted, {len(self.free)} free")
        for _ in range(max(0, need)):
            block = self.free.pop()
            if self.owned[block]:
                raise RuntimeError(f"KV block {block} is free and held at once")
            self.owned[block] = 1
            table.append(block)
        self.peak_held = max(self.peak_held, self.held)

    def release(self, seq: int) -> None:
        """An ended sequence's blocks, back to the pool."""
        table = self.tables.pop(seq)
        for block in table:  # per block, not against the whole free list: a release is frequent
            if not self.owned[block]:
                raise RuntimeError(f"KV block freed twice (sequence {seq})")
            self.owned[block] = 0
        self.free.extend(reversed(table))

    def slots(self, seq: int, start: int, stop: int) -> list[int]:
        """Pool slots of the sequence's tokens [start, stop)."""
        table = self.tables[seq]
        return [
            table[t // BLOCK_TOKENS] * BLOCK_TOKENS + t % BLOCK_TOKENS for t in range(start, stop)
        ]

    def gathered(self, pool: torch.Tensor, slots: torch.Tensor, part: str) -> torch.Tensor:
        """A layer's `pool` rows at `slots` [B, S] -> [B, S, nkv, row], copied by index_select
        into a scratch buffer kept by thread, device and `part` ("k", "v") and grown as needed.
        Indexing `pool[slots]` instead allocated a new tensor a call, whose pages faulted in
        each time: 2.6x the whole attention at 16 decodes of 348 keys in bf16 (docs/decisions.md,
        2026-12-06). A buffer is reused by the next call of its thread, so the rows must be
        used up before it (attend returns a new tensor)."""
        key = (threading.get_ident(), pool.device, part)
        need = slots.numel() * pool[0].numel()
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() < need or scratch.dtype != pool.dtype:
            scratch = self._scratch[key] = torch.empty(need, dtype=pool.dtype, device=pool.device)
        out = scratch[:need].view(slots.numel(), *pool.shape[1:])
        torch.index_select(pool, 0, slots.reshape(-1), out=out)
        return out.view(*slots.shape, *pool.shape[1:])

    def nbytes(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in (*self.k, *self.v):
            out[t.device.type] = out.get(t.device.type, 0.0) + t.numel() * t.element_size()
        return out


def attend(q, keys, values, query_pos, batch_idx, local_idx, *, window=None, sinks=None,
           scale=None, kernel=None) -> torch.Tensor:  # fmt: skip
    """Packed queries q [T, nq, D] of B sequences (query t: sequence batch_idx[t], its
    local_idx[t]-th new token, at position query_pos[t]) against gathered keys and values
    [B, nkv, S, D] (no left padding: sequence b's token t at slot t), each query seeing the keys
    at or before its position (within the last `window`); gpt-oss's `sinks` [nq] join each
    softmax -> [T, nq*Dv]; `kernel`: a pass of decodes' (attend_one_step's). The G query heads
    of a K/V head are stacked along the query axis, so SDPA reads each K/V head once."""
    B, nkv, S, D = keys.shape
    T, G = q.shape[0], q.shape[1] // nkv
    Q = int(local_idx.max()) + 1
    if Q == 1:  # decodes: one query a sequence, in order (executor/passes.py's groups), run as
        # the static decode step runs them: one mask row a sequence, not one a head and query
        mask = _allowed(query_pos.to(keys.device)[:, None], S, window).view(B, 1, 1, S)
        return attend_one_step(q, keys, values, mask, kernel, sinks=sinks, scale=scale)
    q_pad = q.new_zeros(B, Q, nkv, G, D)
    q_pad[batch_idx, local_idx] = q.view(T, nkv, G, D)
    q_pad = q_pad.permute(0, 2, 3, 1, 4).reshape(B, nkv, G * Q, D)
    pos = torch.zeros(B, Q, dtype=torch.long, device=keys.device)
    pos[batch_idx.to(keys.device), local_idx.to(keys.device)] = query_pos.to(keys.device)
    mask = _allowed(pos, S, window)[:, None].expand(B, G, Q, S).reshape(B, 1, G * Q, S)
    if sinks is not None:
        rows = sinks.view(nkv, G, 1).expand(nkv, G, Q).reshape(nkv, G * Q)
        out = eager_sink_attention(q_pad, keys, values, mask, rows, scale)
    else:
        out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=mask, scale=scale)
    out = out.view(B, nkv, G, Q, -1).permute(0, 3, 1, 2, 4)  # [B, Q, nkv, G, Dv]
    return out[batch_idx, local_idx].reshape(T, -1)


def _allowed(pos: torch.Tensor, slots: int, window: int | None) -> torch.Tensor:
    """[B, Q, slots]: the keys each query at `pos` [B, Q] sees, those at or before it (within the
    last `window`)."""
    at = torch.arange(slots, device=pos.device)
    allowed = at[None, None, :] <= pos[:, :, None]
    if window is not None:
        allowed &= pos[:, :, None] - at[None, None, :] < window
    return allowed
