"""The four schedules, each one iterator of actions for one step (reference, section 3, Fig. 6).

A step is the embedding of every micro-batch, then each layer's ops for every micro-batch, then
the LM head. What one micro-batch does in one layer (its chain: pre-attention, the copies,
attention, post-attention) depends on the placement and comes from the runtime; a schedule only
orders chains and weight loads. The engine (executor/engine.py) derives the waits from the data,
so the order below is the whole difference between the schedules:

- `serial` (S3): one queue at a time; a layer's weights are copied whole when the layer starts.
- `overlap` (S2): the next layer's weights are copied whole while this layer computes; no paging.
- `cgopipe` (Algorithm 1): the GPU alternates pre-attention of micro-batch j with post-attention
  of j-1, so CPU attention of j runs while the GPU works on its neighbours; the next layer's
  weights come in m pages, page j right after micro-batch j's attention output (D2).
- `gpu-attention` (S4): the same interleaving, with attention on the GPU over KV prefetched from
  host memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from executor.buffers import TURNS
from executor.engine import Action, Op
from hrm.plan import SCHEDULES

WHOLE_LAYER = -1  # the page index of a load that copies every page of a layer at once


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """What a schedule needs to know about one step."""

    step: int
    num_layers: int
    micro_batches: int
    # (layer, micro-batch) -> its [(op, queue)]: a continuous pass mixes decodes and prompts
    chain: Callable[[int, int], list[tuple[Op, str]]]
    prologue: list[tuple[Op, str]]  # per micro-batch before the first layer (embedding)
    epilogue: list[tuple[Op, str]]  # per micro-batch after the last layer (LM head)
    pages: int  # weight pages per layer; 0 when nothing is streamed
    load_first: bool  # layer 0's weights are not yet on the device (no earlier prefetch)
    load_next_step: bool  # prefetch the next step's layer 0 during the last layer


def _around(shape: StepShape, ops, layer: int) -> Iterator[Action]:
    for j in range(shape.micro_batches):
        for op, queue in ops:
            yield Action(shape.step, layer, j, op, queue)


def _load(shape: StepShape, layer: int, page: int, *, next_step: bool = False) -> Action:
    step = shape.step + 1 if next_step else shape.step
    return Action(step, layer, None, Op.LOAD, "h2d", page=page)


def _load_after(shape: StepShape, layer: int, pages) -> Iterator[Action]:
    """Loads of the layer after `layer` (the next step's layer 0 after the last layer)."""
    if not shape.pages:
        return
    if layer + 1 < shape.num_layers:
        yield from (_load(shape, layer + 1, p) for p in pages)
    elif shape.load_next_step:
        yield from (_load(shape, 0, p, next_step=True) for p in pages)


def serial(shape: StepShape) -> Iterator[Action]:
    yield from _around(shape, shape.prologue, -1)
    for layer in range(shape.num_layers):
        if shape.pages:
            yield _load(shape, layer, WHOLE_LAYER)
        for j in range(shape.micro_batches):
            for op, queue in shape.chain(layer, j):
                yield Action(shape.step, layer, j, op, queue)
    yield from _around(shape, shape.epilogue, shape.num_layers)


def overlap(shape: StepShape) -> Iterator[Action]:
    if shape.pages and shape.load_first:
        yield _load(shape, 0, WHOLE_LAYER)
    yield from _around(shape, shape.prologue, -1)
    for layer in range(shape.num_layers):
        yield from _load_after(shape, layer, [WHOLE_LAYER])  # blocks the h2d queue, as in S2
        for j in range(shape.micro_batches):
            for op, queue in shape.chain(layer, j):
                yield Action(shape.step, layer, j, op, queue)
    yield from _around(shape, shape.epilogue, shape.num_layers)


def cgopipe(shape: StepShape) -> Iterator[Action]:
    m = shape.micro_batches
    if shape.pages and shape.load_first:
        yield from (_load(shape, 0, p) for p in range(shape.pages))
    yield from _around(shape, shape.prologue, -1)
    for layer in range(shape.num_layers):
        halves = [_halves(shape.chain(layer, j)) for j in range(m)]
        # pages of the next layer, spread over this layer's micro-batches (page j after D2 of j)
        pages = [list(range(shape.pages))[p::m] for p in range(m)] if shape.pages else []
        for j in range(m + 1):
            if j < m:
                yield from (Action(shape.step, layer, j, op, q) for op, q in halves[j][0])
            if j >= 1:
                yield from (Action(shape.step, layer, j - 1, op, q) for op, q in halves[j - 1][1])
                if pages:
                    yield from _load_after(shape, layer, pages[j - 1])
    yield from _around(shape, shape.epilogue, shape.num_layers)


def _halves(chain: list[tuple[Op, str]]):
    """A chain cut after its attention: what comes before the GPU's turn to the next
    micro-batch, and what comes after."""
    cut = next(i for i, (op, _) in enumerate(chain) if op is Op.ATTENTION) + 1
    return chain[:cut], chain[cut:]


def dequantize_before_use(actions: Iterator[Action]) -> Iterator[Action]:
    """A compact format's weights (hrm/formats.py): each streamed layer is dequantized on the
    GPU's queue just before the first action that reads its weights, so that its cost overlaps
    the copies of the next layer's pages; every schedule runs a layer's actions after the last
    layer's, so one 16-bit slot serves them all."""
    seen: set[tuple[int, int]] = set()
    for a in actions:
        if a.op in (Op.PRE, Op.POST) and (a.step, a.layer) not in seen:
            seen.add((a.step, a.layer))
            yield Action(a.step, a.layer, None, Op.DEQUANTIZE, a.queue)
        yield a


def read_ahead(
    actions: Iterator[Action], on_disk: Callable[[int], bool], num_layers: int
) -> Iterator[Action]:
    """The disk tier (executor/disk_tier.py): each layer whose weights have a disk part is read
    into the staging of its slot's turn (Op.READ on the "disk" queue) as early as that staging
    is free: right after the last load of the layer before it in that turn, or at the step's
    start. So the reads run a layer ahead of the loads that copy from them, beside every other
    queue, in any schedule; the engine's buffer waits keep each staging from being refilled
    while a load still copies from it."""
    actions = list(actions)
    keys: list[tuple[int, int]] = []  # (step, layer) of the loads reading disk, in order
    last: dict[tuple[int, int], int] = {}
    for i, a in enumerate(actions):
        if a.op is Op.LOAD and on_disk(a.layer):
            key = (a.step, a.layer)
            if key not in last:
                keys.append(key)
            last[key] = i
    after: dict[int, list[tuple[int, int]]] = {}
    first: list[tuple[int, int]] = []
    previous: dict[int, tuple[int, int]] = {}  # staging turn -> the last key read into it
    for key in keys:
        turn = (key[0] * num_layers + key[1]) % TURNS  # the slot's turn (executor/tasks.py)
        if turn in previous:
            after.setdefault(last[previous[turn]], []).append(key)
        else:
            first.append(key)
        previous[turn] = key

    def read(key):
        return Action(key[0], key[1], None, Op.READ, "disk")

    yield from map(read, first)
    for i, a in enumerate(actions):
        yield a
        yield from map(read, after.get(i, ()))


SCHEDULE_ORDERS: dict[str, Callable[[StepShape], Iterator[Action]]] = {
    "serial": serial,
    "overlap": overlap,
    "cgopipe": cgopipe,
    "gpu-attention": cgopipe,  # the same order; its chain runs attention on the GPU
}
assert set(SCHEDULE_ORDERS) == set(SCHEDULES)
