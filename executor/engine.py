"""The one engine: it executes a schedule's actions on their queues, in the schedule's order.

A schedule (executor/schedules.py) is an iterator of actions (step, layer, micro-batch or page,
op, queue); the runtime's task builder (executor/tasks.py) turns each into a Task: a function
plus the buffers it reads and writes (executor/buffers.py). The engine derives every dependency
from those buffers, in schedule order: a task waits for the last writer of what it reads (read
after write) and, before writing, for the last writer and every reader since (write after
read). The schedule decides only the order on each queue; the data decides what waits for what,
so a schedule cannot compute on a half-copied page or overwrite a staging buffer still read.

Queues: "gpu" (compute), "cpu" (attention), "h2d" and "d2h" (the link's two directions), and
"disk" (the disk tier's reads, run by the host like "cpu"). Modes
(`HRM_ENGINE`, see `engine_mode`):
- `threads` (CUDA's default): a thread per queue; on CUDA each device queue issues on a stream of
  its own and waits for another queue's task through that task's event, a CPU task waits for
  the events of the device work it reads. On a CPU the threads run the work itself, so a
  missing wait races; `HRM_ENGINE_JITTER=SEED` adds a seeded delay before each task.
- `inline` (a CPU's default): every task in schedule order on the calling thread. On CUDA the
  device work is still asynchronous on the current stream, so a CPU task waits for the device
  tasks it reads as in `threads`. On a CPU (the stand-in for a GPU, every queue on the same
  cores) this is what runs by default: torch ops on several threads at once each start a
  thread team of their own and oversubscribe the cores, and the cost model's stand-in adds the
  queues up, which is what inline execution does.
- `deferred`: a simulated asynchronous device, on a CPU only. Work on the device queues is
  recorded, not run, and runs when something synchronizes with it: a task on another queue that
  waits for it, or the end of the step. A copy reads its source when it runs, so a missing wait
  or a buffer reused too early gives wrong tokens here as it would on CUDA. Lazy execution
  shows a read that comes too early; with `HRM_ENGINE_JITTER=SEED` a random stream's oldest
  work also runs early now and then, which shows a write that comes too early.
A schedule that runs one queue at a time (`serial`) runs inline in `threads` mode too, and in
`deferred` mode its device work shares one stream, as on CUDA. Every task depends only on tasks
before it, so the earliest unfinished task can always run: the engine cannot deadlock.
"""

from __future__ import annotations

import enum
import os
import random
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from executor.buffers import Buffer
from hrm.errors import HrmError
from hrm.plan import QUEUES

DEVICE_QUEUES = ("gpu", "h2d", "d2h")
# the host's queues: CPU attention, and the disk tier's reads (executor/disk_tier.py)
HOST_QUEUES = ("cpu", "disk")
ENGINE_QUEUES = (*QUEUES, "disk")
MODES = ("inline", "threads", "deferred")
JITTER_MAX_S = 0.002  # the longest delay HRM_ENGINE_JITTER puts before a task


class Op(enum.Enum):
    READ = "read"  # a layer's disk part from the disk tier's file into pinned staging
    LOAD = "load"  # a page (or a whole layer) of weights into a device slot
    DEQUANTIZE = "dequantize"  # a compact format's layer from its slot into the 16-bit one
    EMBED = "embed"
    PRE = "pre"  # norm, QKV, rotary
    QKV_OUT = "qkv_out"  # q, k, v to host staging (D1)
    ATTENTION = "attention"
    ATTN_IN = "attn_in"  # CPU attention's output back to the device (D2)
    KV_IN = "kv_in"  # host KV into a device prefetch buffer
    KV_OUT = "kv_out"  # new K/V from the device into the host cache
    POST = "post"  # O projection, router, experts
    HIDDEN_OUT = "hidden_out"  # prefill hidden states parked in host memory
    HIDDEN_IN = "hidden_in"
    HEAD = "head"  # final norm and LM head


@dataclass(frozen=True)
class Action:
    """One unit of a schedule: what to do (op), for which step, layer and micro-batch, where."""

    step: int
    layer: int  # -1 before the first layer (embedding), num_layers after the last (LM head)
    micro_batch: int | None  # None for a weight load
    op: Op
    queue: str
    page: int | None = None  # a weight load's page (executor.schedules.WHOLE_LAYER: all)


@dataclass(frozen=True)
class Task:
    run: Callable[[], None]
    reads: tuple[Buffer, ...] = ()
    writes: tuple[Buffer, ...] = ()
    nbytes: int = 0  # bytes it moves over the link (h2d / d2h tasks)


@dataclass(eq=False)
class _Done:
    """A task issued: its future (threads), its end event (CUDA), its pending work (deferred)."""

    queue: str
    future: Future | None = None
    event: Any = None
    job: tuple | None = None


@dataclass
class QueueStats:
    busy_s: float = 0.0
    tasks: int = 0
    nbytes: int = 0


def engine_mode(device: torch.device) -> str:
    """The mode HRM_ENGINE asks for on `device` (unset: threads on CUDA, inline on a CPU)."""
    value = os.environ.get("HRM_ENGINE", "").strip()
    if not value:
        return "threads" if device.type == "cuda" else "inline"
    if value not in MODES:
        raise HrmError(
            f"HRM_ENGINE={value!r} is not an engine mode; use one of {', '.join(MODES)} "
            "or leave it unset"
        )
    if value == "deferred" and device.type == "cuda":
        raise HrmError(
            "HRM_ENGINE=deferred simulates an asynchronous GPU on a CPU; a CUDA run runs on "
            "real streams: unset HRM_ENGINE or use threads"
        )
    return value


def jitter_seed() -> int | None:
    """HRM_ENGINE_JITTER as a seed, or None when unset."""
    value = os.environ.get("HRM_ENGINE_JITTER", "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise HrmError(f"HRM_ENGINE_JITTER={value!r}: give an integer seed") from None


class _Hazards:
    """The dependencies of each task in issue order, from the buffers it reads and writes."""

    def __init__(self):
        self.last_writer: dict[Buffer, _Done] = {}
        self.readers: dict[Buffer, list[_Done]] = defaultdict(list)

    def deps(self, task: Task) -> list[_Done]:
        for key in (*task.reads, *task.writes):
            if not isinstance(key, Buffer):
                raise TypeError(f"a task names {key!r}; buffers are executor.buffers keys")
        deps = [self.last_writer[k] for k in task.reads if k in self.last_writer]
        for key in task.writes:
            if key in self.last_writer:
                deps.append(self.last_writer[key])
            deps.extend(self.readers.get(key, ()))
        return deps

    def record(self, task: Task, done: _Done) -> None:
        for key in task.reads:
            self.readers[key].append(done)
        for key in task.writes:
            self.readers.pop(key, None)
            self.last_writer[key] = done


class _Streams:
    """The CUDA side: each device queue's stream (None: the current stream), the events a task
    ends with, and the timing events folded into busy time at each synchronize. `api` is
    torch.cuda, or a recording fake in the tests."""

    def __init__(self, device: torch.device, api, *, own_streams: bool):
        self.api, self.device = api, device
        self.streams = {q: api.Stream(device) if own_streams else None for q in DEVICE_QUEUES}
        self.intervals: dict[str, list] = {q: [] for q in DEVICE_QUEUES}

    def begin_step(self) -> None:
        """Side streams do not wait for the default stream by themselves: what the host queued
        there since the last step (sampling writes the next tokens) must come first."""
        current = self.api.current_stream(self.device)
        for stream in self.streams.values():
            if stream is not None:
                stream.wait_stream(current)

    def launch(self, queue: str, deps: list[_Done], fn: Callable[[], None]):
        """Issue fn's work on the queue's stream after the events of its dependencies."""
        stream = self.streams[queue] or self.api.current_stream(self.device)
        for dep in deps:
            if dep.event is not None:
                stream.wait_event(dep.event)
        start, end = self.api.Event(enable_timing=True), self.api.Event(enable_timing=True)
        with self.api.stream(stream):
            start.record()
            fn()
            end.record()
        self.intervals[queue].append((start, end))
        return end

    @staticmethod
    def host_wait(deps: list[_Done]) -> None:
        """A CPU task waits for the device work it reads: those tasks' events, not the device."""
        for dep in deps:
            if dep.event is not None:
                dep.event.synchronize()

    def synchronize(self) -> dict[str, float]:
        """Wait for every stream; busy seconds per queue since the last call."""
        for stream in self.streams.values():
            if stream is not None:
                stream.synchronize()
        self.api.current_stream(self.device).synchronize()
        busy = {}
        for queue, intervals in self.intervals.items():
            busy[queue] = sum(a.elapsed_time(b) for a, b in intervals) / 1e3
            intervals.clear()
        return busy


class _Deferred:
    """The simulated asynchronous device: pending work per stream, run on demand, in order."""

    def __init__(self, execute, *, one_stream: bool, seed: int | None):
        """seed: also run a random stream's oldest work early, now and then (any order the
        waits allow is one a GPU may take); None: run work only when it must run."""
        self.execute, self.one_stream = execute, one_stream
        self.pending: dict[str, deque[_Done]] = defaultdict(deque)
        self.rng = random.Random(seed) if seed is not None else None

    def submit(self, action: Action, task: Task, deps: list[_Done], done: _Done) -> None:
        if action.queue in HOST_QUEUES:  # the host runs now, after the device work it reads
            self.finish_all(deps)
            self.execute(action, task, deps, done)
        else:
            done.job = (action, task, deps)
            self.pending[self._stream(done.queue)].append(done)
        if self.rng is not None and self.rng.random() < 0.5:
            busy = sorted(name for name, stream in self.pending.items() if stream)
            if busy:
                self.finish(self.pending[self.rng.choice(busy)][0])

    def _stream(self, queue: str) -> str:
        return "device" if self.one_stream else queue

    def finish_all(self, deps: list[_Done]) -> None:
        for dep in deps:
            self.finish(dep)

    def finish(self, done: _Done) -> None:
        """Run done's stream in order up to and including done (and, first, what each waits
        for: only tasks issued earlier, so this ends)."""
        stream = self.pending[self._stream(done.queue)]
        while done.job is not None:
            head = stream[0]
            action, task, deps = head.job
            self.finish_all(deps)
            stream.popleft()
            head.job = None
            self.execute(action, task, deps, head)

    def drain(self) -> None:
        for stream in self.pending.values():
            while stream:
                self.finish(stream[-1])


class Engine:
    """Executes tasks on their queues; keeps per-queue busy time and bytes moved."""

    def __init__(
        self,
        device: torch.device,
        *,
        serial: bool = False,
        mode: str | None = None,
        cuda_api=None,
    ):
        """serial: the schedule runs one queue at a time (inline even in threads mode); mode:
        default engine_mode(device); cuda_api: torch.cuda, or a fake (tests)."""
        requested = mode or engine_mode(device)
        if requested not in MODES:
            raise HrmError(f"engine mode {requested!r}: use one of {', '.join(MODES)}")
        self.mode = "inline" if serial and requested == "threads" else requested
        self.jitter = jitter_seed() if self.mode in ("threads", "deferred") else None
        self.stats = {q: QueueStats() for q in ENGINE_QUEUES}
        on_cuda = device.type == "cuda" or cuda_api is not None
        self.cuda = (
            _Streams(device, cuda_api or torch.cuda, own_streams=self.mode == "threads")
            if on_cuda
            else None
        )
        self._workers: dict[str, ThreadPoolExecutor] = {}
        if self.mode == "threads":
            for q in ENGINE_QUEUES:
                self._workers[q] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hrm-{q}")
        self._deferred = (
            _Deferred(self._execute, one_stream=serial, seed=self.jitter)
            if self.mode == "deferred"
            else None
        )
        self.trace: list[Action] | None = None  # set to a list to record what ran, in order

    def close(self) -> None:
        """Stop the queue threads; tasks not yet started are dropped (Ctrl-C does not wait for
        the rest of the step)."""
        for worker in self._workers.values():
            worker.shutdown(wait=True, cancel_futures=True)
        self._workers.clear()
        self._deferred = None  # it holds this engine's _execute: no cycle outlives the run

    # -- running -------------------------------------------------------------------------------

    def run(self, tasks: Iterable[tuple[Action, Task]]) -> None:
        """Issue one step's tasks. Threads and inline: return when all have finished, re-raising
        the first failure; deferred: device work may still be pending until synchronize()."""
        if self._deferred is not None:
            self._deferred.drain()
        if self.cuda is not None:
            self.cuda.begin_step()
        hazards, submitted = _Hazards(), []
        for action, task in tasks:
            deps = hazards.deps(task)
            done = _Done(queue=action.queue)
            if self.mode == "threads":
                done.future = self._workers[action.queue].submit(
                    self._execute, action, task, deps, done
                )
                submitted.append(done)
            elif self._deferred is not None:
                self._deferred.submit(action, task, deps, done)
            else:
                self._execute(action, task, deps, done)
            hazards.record(task, done)
        errors = [d.future.exception() for d in submitted]
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error

    def _execute(self, action: Action, task: Task, deps: list[_Done], done: _Done) -> None:
        for dep in deps:
            if dep.future is not None:
                dep.future.result()  # re-raises a failed dependency's error here
        if self.jitter is not None and self.mode == "threads":
            time.sleep(random.Random(f"{self.jitter}:{action}").uniform(0, JITTER_MAX_S))
        stats = self.stats[action.queue]
        if self.cuda is not None and action.queue not in HOST_QUEUES:
            done.event = self.cuda.launch(action.queue, deps, lambda: _call(task))
        else:
            if self.cuda is not None:
                self.cuda.host_wait(deps)
            t0 = time.perf_counter()
            _call(task)
            stats.busy_s += time.perf_counter() - t0
        stats.tasks += 1
        stats.nbytes += task.nbytes
        if self.trace is not None:
            self.trace.append(action)

    def synchronize(self) -> None:
        """The end of a step: run deferred work, wait for each CUDA stream (never inside the
        layer loop) and fold the device's timing events into busy time."""
        if self._deferred is not None:
            self._deferred.drain()
        if self.cuda is not None:
            for queue, seconds in self.cuda.synchronize().items():
                self.stats[queue].busy_s += seconds

    def busy_seconds(self) -> dict[str, float]:
        """Busy seconds per queue so far (CUDA queues up to the last synchronize); the disk's
        where the run read from it."""
        return {q: s.busy_s for q, s in self.stats.items() if q in QUEUES or s.tasks}


def _call(task: Task) -> None:
    with torch.inference_mode():  # thread-local: a worker thread must enter it too
        task.run()
