"""A model's weights packed once for the CPU's packed GEMM path (hrm.rules.gemm_paths).

Every matrix that MoEModel.linear multiplies by is reordered at load into oneDNN's blocked
layout, so that no GEMM reorders its weight again: native bf16 reorders on every call, which at
decode's few rows costs as much as the GEMM itself. An expert's gate and up projections are
stacked into one matrix, [2I, H], so that one GEMM computes both (ExpertWeights.w3 is None);
the fused kernel takes them as two parts of one weight instead, each packed where it lies.
What is read another way stays as it is: the embedding (rows looked up), a tied LM head (the
embedding itself), the router where it runs in float32 (grouped routing), DeepSeek's latent
up-projection (split per head), norms and biases. The packed copies replace the model's
references. The checkpoint's own stay with the caller, or, taken over (a checkpoint loaded for
this run only), each storage is released as soon as the last matrix in it is packed, so that
the host never holds the model twice.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from executor.checkpoint import LayerWeights, ModelWeights
from executor.pinning import release_host_tensor
from hrm.rules.gemm_paths import pack_weight
from hrm.rules.host_memory import release_freed_host_memory

# the LayerWeights matrices that go through MoEModel.linear (the router too, unless grouped)
_LINEAR = ("wq", "wk", "wv", "wo", "shared_w1", "shared_w3", "shared_w2", "shared_gate",
           "wq_a", "wkv_a")  # fmt: skip
_EXPERT = ("w1", "w3", "w2")


def packed_weights(
    weights: ModelWeights,
    *,
    router_linear: bool,
    take_over: bool = False,
    fused=None,
    linears=pack_weight,
) -> ModelWeights:
    """`weights` with each matrix MoEModel.linear multiplies by packed (router_linear: the
    router is one of them; grouped routers run in float32 on their own); take_over: each
    original storage released once the last matrix in it is packed (the caller must not read
    them again; one that a tensor left as it is shares is kept); fused: the routed experts'
    packing for the fused kernel (executor/fused_moe.py's pack; a dense layer's MLP is laid out
    as the other matrices). linears: how the other matrices are laid out (oneDNN's packing, or
    the fused kernel's: executor/fused_moe.py linear_packing); None: the routed experts alone,
    for the fused kernel (a path that does not pack: the rest, a dense layer's MLP too, as is)."""
    if linears is None:
        return _experts_only(weights, fused, take_over)
    names = _LINEAR + (("router",) if router_linear else ())
    tied = weights.lm_head is weights.embed
    originals = [t for w in weights.layers for t in _matrices(w, names)]
    originals += [] if tied else [weights.lm_head]
    packer = _Packer(originals, weights) if take_over else _Packer([], None)
    layers = []
    for w in weights.layers:
        packed = {n: packer.pack(getattr(w, n), how=linears)
                  for n in names if getattr(w, n) is not None}  # fmt: skip
        if fused is None or w.router is None:
            experts = tuple(
                dataclasses.replace(e, w1=packer.pack(e.w1, e.w3, how=linears), w3=None,
                                    w2=packer.pack(e.w2, how=linears))
                for e in w.experts
            )  # fmt: skip
        else:
            experts = _fused(w.experts, packer, fused)
        layers.append(dataclasses.replace(w, experts=experts, **packed))
        packer.settle()
    lm_head = weights.lm_head if tied else packer.pack(weights.lm_head, how=linears)
    packer.settle()
    return dataclasses.replace(weights, layers=tuple(layers), lm_head=lm_head)


def _experts_only(weights: ModelWeights, fused, take_over: bool) -> ModelWeights:
    """packed_weights' routed experts laid out by `fused`, the rest untouched."""
    routed = [w for w in weights.layers if w.router is not None]
    originals = [t for w in routed for e in w.experts for t in (e.w1, e.w3, e.w2) if t is not None]
    packer = _Packer(originals, weights) if take_over else _Packer([], None)
    layers = tuple(
        w if w.router is None else dataclasses.replace(w, experts=_fused(w.experts, packer, fused))
        for w in weights.layers
    )  # fmt: skip
    packer.settle()
    return dataclasses.replace(weights, layers=layers)


def _fused(experts, packer: _Packer, fused) -> tuple:
    """Routed experts laid out for the fused kernel: gate and up apart, the kernel's two parts
    of one weight (executor/fused_moe.py grouped), so that each can be packed where it lies."""
    return tuple(
        dataclasses.replace(e, w1=packer.pack(e.w1, how=fused, in_place=True),
                            w3=None if e.w3 is None else packer.pack(e.w3, how=fused,
                                                                     in_place=True),
                            w2=packer.pack(e.w2, how=fused, in_place=True))
        for e in experts
    )  # fmt: skip


class _Packer:
    """Packs matrices one by one, releasing a storage when its last matrix in `originals` is
    packed, unless a tensor of `weights` left as it is shares it (no originals: none released).
    A routed expert's matrix for the fused kernel that is its storage's last and whole is laid
    out over itself, through one scratch buffer kept for the next; other released storages'
    pages go back to the OS after each layer (settle). Otherwise the host held each original's hole
    beside the packed copies: glibc keeps freed memory for reuse (hrm.rules.host_memory), and a
    run's activations spread over the holes (docs/decisions.md, 2026-12-07: packed runs'
    memory)."""

    def __init__(self, originals: list, weights: ModelWeights | None):
        self.pending = Counter(_storage(t) for t in originals)
        packed = {id(t) for t in originals}
        self.kept = set() if weights is None else {_storage(t) for t in _left(weights, packed)}
        self.scratch, self.released = None, False

    def pack(self, *tensors, how=pack_weight, in_place: bool = False):
        """The tensors stacked (by rows) and packed as one matrix (by `how`); in_place: `how`
        can lay a matrix out over itself through a scratch buffer (`how(t, scratch)`), done
        where t is its storage's last matrix and the whole of it."""
        last = [t for t in tensors if self._last(t)]
        if in_place and len(tensors) == 1 and last and _whole(tensors[0]):
            return how(tensors[0], scratch=self._scratch(tensors[0]))
        packed = how(tensors[0] if len(tensors) == 1 else torch.cat(tensors))
        for t in last:
            release_host_tensor(t)
        self.released |= bool(last)
        return packed

    def settle(self) -> None:
        """After a layer: the pages of the storages it released go back to the OS."""
        if self.released:
            release_freed_host_memory()
        self.released = False

    def _last(self, t) -> bool:
        """Whether t is its storage's last matrix to pack, one that may be released."""
        key = _storage(t)
        if key not in self.pending:
            return False
        self.pending[key] -= 1
        return self.pending[key] == 0 and key not in self.kept

    def _scratch(self, t):
        """A buffer of at least t's elements, kept from one matrix to the next."""
        if self.scratch is None or self.scratch.numel() < t.numel():
            self.scratch = None
            self.scratch = torch.empty(t.numel(), dtype=t.dtype)
        return self.scratch


def _whole(t) -> bool:
    """Whether t is the whole of a storage this process owns."""
    storage = t.untyped_storage()
    return (t.is_contiguous() and t.storage_offset() == 0 and storage.resizable()
            and storage.nbytes() == t.nbytes)  # fmt: skip


def _storage(t) -> int:
    return t.untyped_storage().data_ptr()


def _matrices(w: LayerWeights, names: tuple[str, ...]) -> list:
    dense = [getattr(w, n) for n in names if getattr(w, n) is not None]
    return dense + [getattr(e, n) for e in w.experts for n in _EXPERT]


def _left(weights: ModelWeights, packed: set[int]) -> list:
    """The tensors read as they are (embedding, norms, biases, a grouped router...): those
    whose id is not in `packed`."""
    left = [weights.embed, weights.final_norm]
    for w in weights.layers:
        tensors = [getattr(w, f.name) for f in dataclasses.fields(w) if f.name != "experts"]
        tensors += [getattr(e, f.name) for e in w.experts for f in dataclasses.fields(e)]
        left += [t for t in tensors if t is not None and id(t) not in packed]
    return left
