"""A preallocated KV cache for one batch, left-aligned like transformers' padded generate.

Prompts are left-padded to the longest, so slot s holds the s-th step of every sequence and a
decode step writes one slice for the whole batch.  `key_valid` marks the padding slots that
attention must skip.

A layer whose K and V cross the link every step (host memory, attention on the GPU) is stored
slot-major, [S, B, nkv, D], page-aligned so that it can be pinned: its first `end` slots, the
prefetch of a step, are then one contiguous region, one DMA. Every layer is still read and
written through [B, nkv, S, D] views, so attention does not care which layout it has.

A sliding layer (gpt-oss) keeps only its window: W slots used as a ring, absolute slot s at s % W,
so each decode step overwrites the one key that left the window. Its slots are read in ring order
(attention does not care) with the padding mask gathered to match (`mask`).

Latent attention (DeepSeek) caches one row a token, the latent and the rotary key; its values are
that row's first columns, so V stores nothing (rows of width 0, which every copy above moves as
the nothing they are) and `view` gives them from K.

A compact cache (`int8`, `int4`: hrm/formats.py) holds each (token, head) row as its codes
then its groups' scales and minima, uint8 [..., row bytes] in place of [..., D]: every layout,
copy and prefetch above moves those bytes as they are. Writes quantize; `view` gives the rows
dequantized, in the model's dtype.
"""

from __future__ import annotations

import torch

from executor.pinning import page_aligned_empty
from executor.quant import dequantize_rows, quantize_rows
from hrm.formats import row_bytes


class StoredRows:
    """How a cache stores K and V rows and reads them back, for a cache with `format` (a compact
    format, or None), `head_dim`, `dtype` and `value_dim` (latent attention's values, K's first
    columns; None otherwise): the left-padded KVCache and the paged KVBlocks alike."""

    format: str | None
    head_dim: int
    dtype: torch.dtype
    value_dim: int | None

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """K or V [..., D] as the cache stores its rows (latent attention's V, [..., 0]: none)."""
        if self.format is None:
            return x
        if not x.shape[-1]:
            return x.new_empty(x.shape, dtype=torch.uint8)
        return quantize_rows(x, self.format)

    def values(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows [..., row] as K or V [..., D] in the model's dtype."""
        if self.format is None:
            return rows
        return dequantize_rows(rows, self.format, self.head_dim, self.dtype)

    def keys_and_values(self, k_rows: torch.Tensor, v_rows: torch.Tensor):
        """Stored K and V rows (of the cache, or a copy of them) as K and V in the model's
        dtype; latent attention's V is K's first value_dim columns, a view."""
        keys = self.values(k_rows)
        if self.value_dim is not None:
            return keys, keys[..., : self.value_dim]
        return keys, self.values(v_rows)


class KVCache(StoredRows):
    """K and V per layer as [B, nkv, S, D]; S = longest prompt + generation length."""

    # B = batch, nkv = key/value heads, S = slots, D = head dim, T = packed prompt tokens

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        layer_devices: list[torch.device] | None = None,
        slot_major: frozenset[int] = frozenset(),
        kv_format: str | None = None,
        windows: dict[int, int] | None = None,
        value_dim: int | None = None,
    ):
        """layer_devices: where each layer's K and V live (default: all on `device`, which also
        holds the padding mask); an offloaded run keeps some layers on the GPU. slot_major: the
        host layers stored slot-major (see the module docstring). kv_format: a compact format
        the rows are stored in (None: `dtype`). windows: layer -> the keys its queries see; a
        window shorter than max_len makes the layer a ring of that many slots. value_dim: latent
        attention's values, K's first value_dim columns (V then stores nothing)."""
        self.format, self.dtype, self.head_dim = kv_format, dtype, head_dim
        self.value_dim = value_dim
        row = head_dim
        if kv_format is not None:
            row, dtype = row_bytes(head_dim, kv_format), torch.uint8
        v_row = 0 if value_dim is not None else row
        self.rings = {i: w for i, w in (windows or {}).items() if w < max_len}  # layer -> W
        devices = layer_devices or [torch.device(device)] * num_layers
        self.slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> [S, B, nkv, D]
        self.k, self.v = [], []
        for layer, d in enumerate(devices):
            shape = (batch_size, kv_heads, self.rings.get(layer, max_len), row)
            v_shape = (*shape[:3], v_row)
            if layer in slot_major:
                k, v = (_slot_major(s, dtype) for s in (shape, v_shape))
                self.slots[layer] = (k, v)
                k, v = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
            else:
                # Zeros, not empty: padding slots are masked out of attention, but a NaN left in
                # uninitialised memory would still poison the weighted sum (0 * NaN = NaN).
                k, v = (torch.zeros(s, dtype=dtype, device=d) for s in (shape, v_shape))
            self.k.append(k)
            self.v.append(v)
        self.key_valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # [B, S]
        self._valid_on: dict[torch.device, torch.Tensor] = {}
        self.has_padding = False
        self.length = 0  # slots filled, the same for every sequence
        self.token_bytes = kv_heads * (row + v_row) * dtype.itemsize  # K and V, a token, a layer

    @classmethod
    def for_model(
        cls, arch, *, batch_size: int, max_len: int, dtype: torch.dtype, num_layers=None,
        windowed: bool = True, **kw,
    ) -> KVCache:  # fmt: skip
        """The one place a cache takes a model's dimensions (ModelArch): its key/value heads and
        head size, every layer unless `num_layers` (a profiler's rotation) says otherwise, each
        sliding layer a ring of its window when the cache holds the model's layers (windowed);
        `kw` as __init__ (device, layer_devices, slot_major, kv_format)."""
        layers = kw.get("layer_devices")
        windowed = windowed and num_layers is None
        return cls(
            num_layers=num_layers or (len(layers) if layers else arch.num_layers),
            batch_size=batch_size,
            kv_heads=arch.num_key_value_heads,
            max_len=max_len,
            head_dim=arch.head_dim,
            dtype=dtype,
            value_dim=arch.kv_lora_rank or None,
            windows={i: arch.window(i) for i in arch.sliding_layers} if windowed else None,
            **kw,
        )

    # -- the slots of a layer (a ring's: its window) -------------------------------------------

    def filled(self, layer: int, end: int) -> int:
        """Slots of `layer` that hold the keys of absolute slots [0, end) a query may read."""
        return min(end, self.rings[layer]) if layer in self.rings else end

    def position(self, layer: int, slot: int) -> int:
        """Where absolute slot `slot` lies in `layer`."""
        return slot % self.rings[layer] if layer in self.rings else slot

    @property
    def max_len(self) -> int:
        return self.key_valid.shape[1]

    def start(self, prompt_lens: torch.Tensor, padded_len: int) -> None:
        """Mark left-padded prompt slots: sequence b fills [padded_len - len_b, padded_len)."""
        slots = torch.arange(self.max_len, device=self.key_valid.device)
        self.key_valid[:] = slots[None, :] >= (padded_len - prompt_lens)[:, None]  # [B, S]
        self.key_valid[:, padded_len:] = True
        self.has_padding = bool((prompt_lens != padded_len).any())
        self.length = padded_len
        self._valid_on.clear()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only sequences `rows` (indices, in order), for the steps after some stopped. A
        slot-major layer is rewritten into the front of its own (pinned) storage, contiguous."""
        for layer in range(len(self.k)):
            if layer in self.slots:
                pair = []
                for t in self.slots[layer]:
                    kept = t[:, rows].clone()  # [S, b, nkv, D]
                    front = t.view(-1)[: kept.numel()].view(kept.shape)
                    pair.append(front.copy_(kept))
                self.slots[layer] = (pair[0], pair[1])
                self.k[layer], self.v[layer] = (t.permute(1, 2, 0, 3) for t in pair)
            else:
                index = rows.to(self.k[layer].device)
                self.k[layer], self.v[layer] = self.k[layer][index], self.v[layer][index]
        self.key_valid = self.key_valid[rows.to(self.key_valid.device)]
        self.has_padding = not bool(self.key_valid.all())
        self._valid_on.clear()

    def write_prompts(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        batch_idx: torch.Tensor,
        slot_idx: torch.Tensor,
    ) -> None:
        """Scatter packed prompt K/V [T, nkv, D] into their (sequence, slot) places; a ring keeps
        the slots of its window."""
        if layer in self.rings:
            keep = slot_idx >= self.length - self.rings[layer]
            batch_idx, slot_idx, k, v = batch_idx[keep], slot_idx[keep], k[keep], v[keep]
            slot_idx = slot_idx % self.rings[layer]
        self.k[layer][batch_idx, :, slot_idx] = self.stored(k)
        self.v[layer][batch_idx, :, slot_idx] = self.stored(v)

    def write_prompt_slots(self, layer: int, k: torch.Tensor, v: torch.Tensor, **copy) -> None:
        """The prompts' K/V of all slots [B, nkv, L, D] (a transient device cache's, L = length)
        into `layer`, a ring's window only, as at most two contiguous copies each; `copy` as
        Tensor.copy_'s (non_blocking)."""
        L = self.length
        start = L - self.filled(layer, L)
        first = self.position(layer, start)
        for i, t in enumerate((k, v)):
            t = t[:, :, start:]
            if layer in self.slots:  # slot-major [S, B, nkv, D]
                _copy_wrapped(self.slots[layer][i], t.permute(2, 0, 1, 3).contiguous(), first, 0,
                              **copy)  # fmt: skip
            else:  # read by CPU attention in place: [B, nkv, S, D], strided
                _copy_wrapped((self.k, self.v)[i][layer], t, first, 2, **copy)

    def write_step(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one decode step's K/V [B, nkv, D] at slot `length`."""
        at = self.position(layer, self.length)
        self.k[layer][:, :, at] = self.stored(k)
        self.v[layer][:, :, at] = self.stored(v)

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots [0, end) as [B, nkv, end, D] (a ring: its filled slots, in ring
        order): views (no copy), or a compact cache's rows dequantized."""
        n = self.filled(layer, end)
        return self.keys_and_values(self.k[layer][:, :, :n], self.v[layer][:, :, :n])

    def valid_on(self, device: torch.device) -> torch.Tensor:
        """The padding mask [B, S] on `device` (copied once per batch; it is fixed after start)."""
        if device == self.key_valid.device:
            return self.key_valid
        if device not in self._valid_on:
            self._valid_on[device] = self.key_valid.to(device)
        return self._valid_on[device]

    def mask(
        self, end: int, device: torch.device | None = None, layer: int | None = None
    ) -> torch.Tensor | None:
        """[B, 1, 1, end] keys a query may see (on `device`, default the mask's own), or None
        when no sequence is padded; a ring layer's in its slots' order."""
        if not self.has_padding:
            return None
        valid = self.key_valid if device is None else self.valid_on(device)
        if layer not in self.rings or end <= self.rings[layer]:
            return valid[:, None, None, :end]
        W = self.rings[layer]
        r = torch.arange(W, device=valid.device)
        absolute = r + W * ((end - 1 - r) // W)  # the latest slot < end at each ring position
        return valid[:, None, None, absolute]

    def slot_major_tensors(self) -> list[torch.Tensor]:
        """The slot-major layers' storage (what a CUDA run pins; latent attention's empty V is
        nothing to pin)."""
        return [t for pair in self.slots.values() for t in pair if t.numel()]

    @property
    def nbytes(self) -> dict[str, float]:
        """Bytes of K and V by device type ("cpu", "cuda")."""
        out: dict[str, float] = {}
        for t in (*self.k, *self.v):
            out[t.device.type] = out.get(t.device.type, 0.0) + t.numel() * t.element_size()
        return out


def _copy_wrapped(dst: torch.Tensor, src: torch.Tensor, first: int, dim: int, **copy) -> None:
    """src's slots along `dim` into dst's from `first` on, wrapping to dst's start."""
    n = min(src.shape[dim], dst.shape[dim] - first)
    dst.narrow(dim, first, n).copy_(src.narrow(dim, 0, n), **copy)
    if n < src.shape[dim]:
        rest = src.shape[dim] - n
        dst.narrow(dim, 0, rest).copy_(src.narrow(dim, n, rest), **copy)


def _slot_major(shape: tuple[int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """Zeros [S, B, nkv, D] for a [B, nkv, S, D] shape, in host memory on a page boundary."""
    B, nkv, S, D = shape
    return page_aligned_empty(S * B * nkv * D, dtype).zero_().view(S, B, nkv, D)


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
