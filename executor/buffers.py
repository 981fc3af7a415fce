"""The buffers a task reads and writes: the keys the engine orders tasks by.

A key is typed and made by one of the constructors below, never an ad-hoc tuple: a misspelt
tuple would be a buffer nobody else names, and the wait it should have caused would silently
not happen. The engine refuses any key that is not a `Buffer`.
"""

from __future__ import annotations

from dataclasses import dataclass

# Double buffering: two weight slots, two staging sets and two KV prefetch buffers alternate, so
# that one can fill while the other is read.
TURNS = 2


@dataclass(frozen=True)
class Buffer:
    name: str
    index: tuple[int, ...]


def hidden(j: int) -> Buffer:
    """Micro-batch j's hidden states (and rotary tables) on the device running the layers."""
    return Buffer("hidden", (j,))


def hidden_host(j: int) -> Buffer:
    """Micro-batch j's prefill hidden states parked in host memory between layers."""
    return Buffer("hidden_host", (j,))


def qkv(j: int) -> Buffer:
    return Buffer("qkv", (j,))


def attn(j: int) -> Buffer:
    """Micro-batch j's attention output, on the device running the layers."""
    return Buffer("attn", (j,))


def logits(j: int) -> Buffer:
    return Buffer("logits", (j,))


def kv(j: int, layer: int) -> Buffer:
    """Micro-batch j's KV cache of one layer, where that layer keeps it."""
    return Buffer("kv", (j, layer))


def kv_device(j: int) -> Buffer:
    """The transient device cache a prefill attends over before it goes to host memory."""
    return Buffer("kv_device", (j,))


def stage_in(turn: int) -> Buffer:
    """Pinned host staging of q, k and v for CPU attention (D1)."""
    return Buffer("stage_in", (turn % TURNS,))


def stage_out(turn: int) -> Buffer:
    """Pinned host staging of CPU attention's output (D2)."""
    return Buffer("stage_out", (turn % TURNS,))


def prefetch(turn: int) -> Buffer:
    """A device buffer of K and V prefetched from host memory for GPU attention."""
    return Buffer("prefetch", (turn % TURNS,))


def dequantized() -> Buffer:
    """The one device slot a compact format's streamed layer is dequantized into."""
    return Buffer("dequantized", ())


def weight_page(slot: int, page: int) -> Buffer:
    """One page of a device weight slot."""
    return Buffer("weight_page", (slot % TURNS, page))


def disk_stage(turn: int) -> Buffer:
    """Pinned host staging of one layer's disk part, read from the disk tier's file (READ)."""
    return Buffer("disk_stage", (turn % TURNS,))
