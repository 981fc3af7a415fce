"""Where every weight lives during an offloaded run: resident on the device, or streamed in pages.

hrm.rules.placement decides which tensors are resident (the same function the planner counts). The
rest of each layer is packed, in placement order, into one host arena per layer of exactly its
size: PyTorch's pinned caching allocator rounds a request up to a power of two, so on CUDA the
arena is ordinary page-aligned memory registered with the CUDA runtime (executor/pinning.py),
which pins exactly those bytes. Packing copies each tensor, so DBRX's transposed w2 views become
contiguous there.

On the device, two slots each hold one layer's streamed tensors (the current layer and the next);
a slot is cut into pages at tensor boundaries, and a page is the unit of one copy. The page table
maps (layer, expert) to the slot that holds it for the current pass of the layer; the expert FFN
reads its weights through it.

Arenas, slots and pages are bytes. In a compact format (hrm/formats.py) the arenas hold the
quantized rows, the pages move them as they are, and `dequantize` writes a layer from its slot
into the one slot of the weights' dtype the layers read (the schedule's DEQUANTIZE action).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from executor.buffers import TURNS
from executor.checkpoint import ExpertWeights, LayerWeights, ModelWeights
from executor.pinning import HostPins, page_aligned_empty, release_host_tensor
from executor.quant import dequantize_into, dequantized, quantize
from hrm.arch import ModelArch
from hrm.formats import is_compact, is_quantized, stored_bytes
from hrm.progress import progress
from hrm.rules.placement import (
    EXPERT_TENSORS,
    ModelPlacement,
    WeightPlacement,
    cut_pages,
    dense_shapes,
    expert_shapes,
    streamed_tensors,
)


@dataclass(frozen=True, kw_only=True)
class _Entry:
    """One streamed tensor: where its stored bytes sit in the arena (and a slot), and where its
    elements sit in the slot the layers compute from."""

    key: tuple  # (name,) or (expert, name)
    shape: tuple[int, ...]
    offset: int  # stored bytes
    nbytes: int
    element: int  # offset in elements of the compute dtype
    quantized: bool  # stored in the compact format (hrm/formats.py)


@dataclass(frozen=True, kw_only=True)
class _Layout:
    """One kind of layer's streamed tensors in arena order, and its pages (stored byte ranges)."""

    arch: ModelArch  # the kind's geometry (ModelArch.layer_kinds)
    placement: WeightPlacement
    tensors: tuple[_Entry, ...]
    nbytes: int
    elements: int
    pages: tuple[tuple[int, int], ...]

    @classmethod
    def of(
        cls, arch: ModelArch, placement: WeightPlacement, pages: int, fmt: str, itemsize: int
    ) -> _Layout:
        tensors, offset, element = [], 0, 0
        for key, shape in streamed_tensors(arch, placement):
            nbytes = stored_bytes(key[-1], shape, fmt, itemsize)
            quantized = is_quantized(key[-1], shape, fmt)
            tensors.append(_Entry(key=key, shape=shape, offset=offset, nbytes=nbytes,
                                  element=element, quantized=quantized))  # fmt: skip
            offset, element = offset + nbytes, element + math.prod(shape)
        cut = cut_pages([t.nbytes for t in tensors], pages)
        return cls(
            arch=arch, placement=placement, tensors=tuple(tensors), nbytes=offset,
            elements=element, pages=tuple(cut),
        )  # fmt: skip

    @property
    def dense_names(self) -> tuple[str, ...]:
        return tuple(dense_shapes(self.arch))  # the kind's LayerWeights fields

    @property
    def expert_names(self) -> tuple[str, ...]:
        return tuple(expert_shapes(self.arch))  # the kind's ExpertWeights fields


class WeightStore:
    """Resident weights, host arenas, the device's page slots and the page table."""

    def __init__(
        self,
        weights: ModelWeights,
        placement: ModelPlacement,
        device: torch.device,
        *,
        pages: int,
        weight_format: str | None = None,
        staged: bool = False,
        take_over: bool = False,
        quiet: bool = True,
        disk=None,
    ):
        """pages: per layer, cut at tensor boundaries (a layer of a smaller kind may have fewer);
        weight_format: a compact format (hrm/formats.py) the streamed weights are quantized to
        here, moved in, and dequantized from on the device into one slot of the weights' dtype;
        staged: keep the arenas pageable and copy each page through a ring of two pinned
        staging pages (the plan's "weight staging"); also taken when the host refuses to pin.
        take_over: the checkpoint's layers and LM head are released as soon as they are copied
        here, so the host never holds the model twice (the plan counts one copy); the caller
        must not read them again. disk: (share, directory, direct, sources) for a disk tier
        (executor/disk_tier.py): the last `share` of each layer's streamed bytes is kept off the
        arena and read back once a pass (Op.READ), from the checkpoint's files where `sources`
        (Checkpoint.source) finds its tensors there, else from a file under `directory`."""
        self.arch, self.placement, self.device = placement.arch, placement, device
        dtype = weights.embed.dtype
        self.format = weight_format or str(dtype).removeprefix("torch.")
        self.compact = is_compact(self.format)
        self.layouts = {
            k.ffn_is_dense: _Layout.of(k, p, pages, self.format, dtype.itemsize)
            for k, _, p in placement.kinds
        }
        self.streamed_bytes = max(lay.nbytes for lay in self.layouts.values())
        self.page_count = max(len(lay.pages) for lay in self.layouts.values())
        self.staged = staged
        self.arenas: dict[int, torch.Tensor] = {}  # layer -> its streamed tensors, packed
        self.resident = []
        # layer -> where its disk part starts in its arena's bytes (the arena holds what is before)
        self.disk_start: dict[int, int] = {}
        self.disk = self._disk_tier(disk, device) if disk is not None else None
        layers = weights.layers
        if self.compact and self.streamed_bytes:
            layers = progress(layers, desc=f"quantizing to {self.format}", quiet=quiet)
        self._place(layers, dtype, take_over)
        self.pins = HostPins()
        self.pinned = False
        if self.arenas and device.type == "cuda" and not staged:
            self.pinned = self.pins.pin_all(list(self.arenas.values()))
            self.staged = not self.pinned  # the host refused: stage every page
        page = max((e - s for lay in self.layouts.values() for s, e in lay.pages), default=0)
        self.ring = [
            torch.empty(page, dtype=torch.uint8, pin_memory=device.type == "cuda")
            for _ in range(TURNS if self.staged else 0)
        ]
        self._ring_turn = 0
        self._ring_done: list = [None] * len(self.ring)  # CUDA events: DMA out of each ring page
        count = self.streamed_bytes
        self.slots = [_slot(count, torch.uint8, device) for _ in range(TURNS if count else 0)]
        # a compact format: the one slot of the weights' dtype the layer computing is
        # dequantized into (the largest kind's streamed elements)
        elements = max(lay.elements for lay in self.layouts.values())
        self.dequantized = [_slot(elements, dtype, device)] if self.compact and count else []
        # views of the slots the layers read: the one 16-bit slot, or each streamed slot
        self.slot_views = [
            {dense: _views(lay, flat, dtype) for dense, lay in self.layouts.items()}
            for flat in (self.dequantized if self.compact else self.slots)
        ]
        self.page_table: dict[tuple[int, int], int] = {}  # (layer, expert) -> slot
        self.mapped: Counter[tuple[int, int]] = Counter()  # (layer, expert) -> passes mapped
        self.h2d_bytes = 0
        self.lm_head = _copy_to(weights.lm_head, device)
        self.final_norm = _copy_to(weights.final_norm, device)
        if take_over and weights.lm_head is not weights.embed:
            release_host_tensor(weights.lm_head)

    # -- building ------------------------------------------------------------------------------

    def _disk_tier(self, disk, device: torch.device):
        """The disk tier's file and staging: the last `share` of every streamed layer's bytes,
        rounded up to a byte (the host keeps no more than the plan counts)."""
        from executor.disk_tier import DiskTier

        share, directory, direct, self._sources = disk
        for i in range(self.arch.num_layers):
            layout = self._layout(i)
            start = layout.nbytes - min(layout.nbytes, math.ceil(share * layout.nbytes))
            if layout.nbytes and not self.compact:  # whole tensors: readable in place
                start = max((t.offset for t in layout.tensors if t.offset <= start), default=0)
            if layout.nbytes:
                self.disk_start[i] = start
        parts = {i: self._layout(i).nbytes - s for i, s in self.disk_start.items()}
        return DiskTier(directory, {i: n for i, n in parts.items() if n}, device, direct=direct)

    def _place(self, layers, dtype: torch.dtype, take_over: bool) -> None:
        """Each layer's streamed tensors into its arena (its disk part to the disk tier's file),
        its resident ones onto the device; the checkpoint's copies released when taken over."""
        for i, w in enumerate(layers):
            layout = self._layout(i)
            pieces = self._in_place(i, w)
            if pieces:  # the arena holds the head; the tail is read from the checkpoint
                self.arenas[i] = _fill_arena(layout, w, dtype, self.format, self.disk_start[i])
                self.disk.point(i, pieces)
            elif layout.nbytes:
                self.arenas[i] = self._kept(i, _fill_arena(layout, w, dtype, self.format))
            self.resident.append(self._resident(layout, w))
            if take_over:
                for t in (getattr(w, n) for n in layout.dense_names):
                    release_host_tensor(t)
                for t in (getattr(e, n) for e in w.experts for n in layout.expert_names):
                    release_host_tensor(t)
        if self.disk is not None:
            self.disk.open()

    def _in_place(self, layer: int, w: LayerWeights) -> list | None:
        """The layer's disk part as pieces of the checkpoint's own files, where every tensor of
        it is a contiguous view of one (stored as the run computes it); else None."""
        start = self.disk_start.get(layer)
        # a compact format's part holds quantized rows, and starts inside a tensor
        if self.disk is None or self.compact or layer not in self.disk.parts:
            return None
        pieces = []
        for t in self._layout(layer).tensors:
            if t.offset >= start:
                source = self._sources(_tensor(w, t.key))
                if source is None:
                    return None
                pieces.append((t.offset - start, source[0], source[1], t.nbytes))
        return pieces

    def _kept(self, layer: int, arena: torch.Tensor) -> torch.Tensor:
        """The arena the host keeps: all of it, or its head, its tail written to the disk tier."""
        start = self.disk_start.get(layer)
        if start is None or start == arena.numel():
            return arena
        self.disk.write(layer, arena[start:])
        head = page_aligned_empty(start, torch.uint8)
        head.copy_(arena[:start])
        return head

    def _layout(self, layer: int) -> _Layout:
        return self.layouts[self.arch.is_dense(layer)]

    def _resident(self, layout: _Layout, w: LayerWeights) -> dict[tuple, torch.Tensor]:
        """The layer's resident tensors, copied to the device (a copy even when the device is the
        CPU standing in for a GPU, so that the host and the "device" hold their own bytes); in a
        compact format with its values, dequantized there, as a streamed copy would be."""
        p = layout.placement
        keys = [(n,) for n in layout.dense_names] if p.dense_resident else []
        keys += [(e, n) for e in range(p.resident_experts) for n in layout.expert_names]
        return {
            k: dequantized(_copy_to(_tensor(w, k), self.device), k[-1], self.format) for k in keys
        }

    # -- running -------------------------------------------------------------------------------

    @property
    def streams(self) -> bool:
        return self.streamed_bytes > 0

    def page_bytes(self, layer: int, page: int) -> int:
        """Bytes of page `page` of `layer`: 0 past the pages of its kind."""
        pages = self._layout(layer).pages
        if page >= len(pages):
            return 0
        start, end = pages[page]
        return end - start

    def copy_page(self, layer: int, page: int, slot: int) -> None:
        """Page `page` of `layer` (all pages when page < 0) into `slot`; maps its experts. A page
        past the pages of the layer's kind copies nothing. What lies past the layer's disk start
        comes from the disk tier's staging of the same turn as the slot (read by Op.READ)."""
        layout = self._layout(layer)
        if page >= len(layout.pages):
            return
        split = self.disk_start.get(layer, layout.nbytes)
        for first, last in layout.pages if page < 0 else [layout.pages[page]]:
            if first < split:
                src, dst = self.arenas[layer][first : min(last, split)], self.slots[slot]
                if self.staged:
                    self._copy_staged(src, dst[first : min(last, split)])
                else:
                    dst[first : min(last, split)].copy_(src, non_blocking=self.pinned)
            if last > split:
                start = max(first, split)
                src = self.disk.staging[slot][start - split : last - split]
                self.slots[slot][start:last].copy_(src, non_blocking=bool(self.disk.pins.pinned))
            self.h2d_bytes += last - first
        start, end = (0, layout.nbytes) if page < 0 else layout.pages[page]
        for t in layout.tensors:
            if len(t.key) == 2 and t.key[1] == EXPERT_TENSORS[0] and start <= t.offset < end:
                self.page_table[(layer, t.key[0])] = slot
                self.mapped[(layer, t.key[0])] += 1

    def reads_disk(self, layer: int, page: int) -> bool:
        """Whether the page (all pages when page < 0) takes bytes from the disk tier."""
        layout, start = self._layout(layer), self.disk_start.get(layer)
        if start is None or start == layout.nbytes or page >= len(layout.pages):
            return False
        return page < 0 or layout.pages[page][1] > start

    def read_disk(self, layer: int, slot: int) -> None:
        """The layer's disk part into the disk tier's staging of the slot's turn (Op.READ)."""
        self.disk.read(layer, slot)

    def disk_part(self, layer: int) -> int:
        return self.disk.parts.get(layer, 0) if self.disk is not None else 0

    def dequantize(self, layer: int, slot: int) -> None:
        """A compact format: `layer`'s streamed tensors from `slot` (all its pages in) into the
        slot the layers compute from, on the device (the schedule's DEQUANTIZE action)."""
        layout = self._layout(layer)
        flat = self.slots[slot]
        views = self._read_views(0)[layout.arch.ffn_is_dense]
        for t in layout.tensors:
            stored = flat[t.offset : t.offset + t.nbytes]
            if t.quantized:
                dequantize_into(views[t.key], stored, self.format)
            else:
                views[t.key].view(-1).copy_(stored.view(views[t.key].dtype))

    def _copy_staged(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Pageable arena -> pinned ring page (a host memcpy) -> device (asynchronous): the next
        page's memcpy overlaps this page's DMA, and a ring page is reused only after its DMA."""
        turn = self._ring_turn
        self._ring_turn = (turn + 1) % len(self.ring)
        if self._ring_done[turn] is not None:
            self._ring_done[turn].synchronize()
        ring = self.ring[turn][: src.numel()]
        ring.copy_(src)
        dst.copy_(ring, non_blocking=dst.is_cuda)
        if dst.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self._ring_done[turn] = event

    def layer(self, layer: int, slot: int) -> LayerWeights:
        """The layer's weights as the model reads them: resident tensors, else the slot's views;
        experts through the page table."""
        resident, layout = self.resident[layer], self._layout(layer)
        views = self._read_views(slot)[layout.arch.ffn_is_dense] if self.slots else {}

        def dense(name: str) -> torch.Tensor:
            return resident[(name,)] if (name,) in resident else views[(name,)]

        experts = tuple(self._expert(layer, e) for e in range(layout.arch.num_experts))
        return LayerWeights(**{n: dense(n) for n in layout.dense_names}, experts=experts)

    def _expert(self, layer: int, e: int) -> ExpertWeights:
        resident, names = self.resident[layer], self._layout(layer).expert_names
        if (e, "w1") in resident:
            return ExpertWeights(**{n: resident[(e, n)] for n in names})
        dense = self.arch.is_dense(layer)
        views = self._read_views(self.page_table[(layer, e)])[dense]
        return ExpertWeights(**{n: views[(e, n)] for n in names})

    def _read_views(self, slot: int) -> dict:
        """The views the layers read a layer in `slot` through: a compact format's one 16-bit
        slot whichever slot its pages came into."""
        return self.slot_views[0 if self.compact else slot]

    def close(self) -> None:
        """Unpin the arenas (after the device's work on them) before their memory is freed;
        close the disk tier's files."""
        self.pins.close()
        self.pinned = False
        if self.disk is not None:
            self.disk.close()

    def allocated_bytes(self) -> dict[str, dict[str, float]]:
        """Bytes per buffer, by the planner's names (planner/memory.py)."""

        def size(tensors) -> float:
            return float(sum(t.numel() * t.element_size() for t in tensors))

        return {
            "gpu": {
                "resident weights": size(t for r in self.resident for t in r.values()),
                "paged buffer": size(self.slots),
                "lm head": size([self.lm_head, self.final_norm]),
            }
            | ({"dequantized layer": size(self.dequantized)} if self.dequantized else {}),
            "cpu": {"layer weights": size(self.arenas.values())}
            | ({"weight staging": size(self.ring)} if self.staged else {})
            | ({"disk staging": size(self.disk.staging)} if self.disk is not None else {}),
        }


def _fill_arena(
    layout: _Layout, w: LayerWeights, dtype: torch.dtype, fmt: str, upto: int | None = None
) -> torch.Tensor:
    """The layer's streamed tensors packed; with `upto`, the head of them before that byte."""
    arena = page_aligned_empty(layout.nbytes if upto is None else upto, torch.uint8)
    for t in (t for t in layout.tensors if upto is None or t.offset < upto):
        stored = arena[t.offset : t.offset + t.nbytes]
        if t.quantized:
            stored.copy_(quantize(_tensor(w, t.key), fmt))
        else:
            stored.view(dtype).view(t.shape).copy_(_tensor(w, t.key))
    return arena


def _views(layout: _Layout, flat: torch.Tensor, dtype: torch.dtype) -> dict[tuple, torch.Tensor]:
    """Each tensor of `layout` in `flat`, as `dtype`: at its byte offset in a slot of stored
    bytes (uint8), else at its element offset in a compact format's slot of the weights' dtype."""
    if flat.dtype == torch.uint8:
        return {
            t.key: flat[t.offset : t.offset + t.nbytes].view(dtype).view(t.shape)
            for t in layout.tensors
        }
    return {
        t.key: flat[t.element : t.element + math.prod(t.shape)].view(t.shape)
        for t in layout.tensors
    }


def _slot(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One page slot: on a GPU from its allocator; on the CPU standing in, mapped memory of its
    own (pinning.page_aligned_empty), touched now so that the run's first step does not fault
    it in."""
    if device.type == "cpu":
        return page_aligned_empty(numel, dtype).zero_()
    return torch.empty(numel, dtype=dtype, device=device)


def _copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous copy on `device`, made in one pass (a transposed view included)."""
    return torch.empty(t.shape, dtype=t.dtype, device=device).copy_(t)


def _tensor(w: LayerWeights, key: tuple) -> torch.Tensor:
    if len(key) == 1:
        return getattr(w, key[0])
    return getattr(w.experts[key[0]], key[1])
