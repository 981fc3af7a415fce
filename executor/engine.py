"""The one engine: it executes a schedule's actions on their queues, in the schedule's order.

A schedule (executor/schedules.py) is an iterator of actions (step, layer, micro-batch, op,
queue); the runtime (executor/runtime.py) turns each into a Task: a function plus the buffers it
reads and writes. The engine derives every dependency from those buffers, in schedule order:
a task waits for the last writer of what it reads (read after write) and, before writing, for the
last writer and every reader since (write after read). The schedule decides only the order on
each queue; the data decides what waits for what, so a schedule cannot compute on a half-copied
page or overwrite a staging buffer still being read.

Queues: "gpu" (compute), "cpu" (attention workers), "h2d" and "d2h" (the link's two directions).
Each runs its tasks in order on a thread of its own; on CUDA a queue other than "cpu" issues its
work on a CUDA stream of its own, and waits for another stream's task through that task's event
(never a device-wide synchronisation). A task always depends only on tasks listed before it, so
the earliest unfinished task can always run: the engine cannot deadlock. `inline` runs every task
in order on the calling thread: the serial schedule, and a run with a single queue.
On a CPU (the stand-in for a GPU: every queue on the same cores) every run is inline, in the
schedule's order: torch ops on several threads at once each start a thread team of their own and
oversubscribe the cores (cgopipe ran at half the serial schedule's speed on 2 cores in fp32), and
even taking turns under a lock, the idle teams' spinning slowed the running one by 20%. The cost
model's stand-in adds the queues up (planner/cost.py), which is what inline execution does.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

QUEUES = ("gpu", "cpu", "h2d", "d2h")


@dataclass(frozen=True)
class Action:
    """One unit of a schedule: what to do (op), for which step, layer and micro-batch, where."""

    step: int
    layer: int  # -1 before the first layer (embedding), num_layers after the last (LM head)
    micro_batch: int  # for a weight load: the page index
    op: str
    queue: str


@dataclass(frozen=True)
class Task:
    run: Callable[[], None]
    reads: tuple[Hashable, ...] = ()
    writes: tuple[Hashable, ...] = ()
    nbytes: int = 0  # bytes it moves over the link (h2d / d2h tasks)


@dataclass
class _Done:
    """A finished (or submitted) task: its future, and on a CUDA stream its end event."""

    future: Future | None
    event: torch.cuda.Event | None = None
    queue: str = "gpu"


@dataclass
class QueueStats:
    busy_s: float = 0.0
    tasks: int = 0
    nbytes: int = 0
    cuda_intervals: list = field(default_factory=list)  # (start, end) events, read after a sync


class Engine:
    """Executes tasks on their queues; keeps per-queue busy time and bytes moved."""

    def __init__(self, device: torch.device, *, inline: bool):
        self.device = device
        self.inline = inline or device.type == "cpu"  # see the module docstring
        self.on_cuda = device.type == "cuda"
        self.stats = {q: QueueStats() for q in QUEUES}
        self._workers: dict[str, ThreadPoolExecutor] = {}
        self._streams: dict[str, torch.cuda.Stream] = {}
        if not self.inline:
            for q in QUEUES:
                self._workers[q] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hrm-{q}")
        if self.on_cuda:
            for q in ("gpu", "h2d", "d2h"):
                self._streams[q] = torch.cuda.Stream(device) if not inline else None
        self.trace: list[Action] | None = None  # set to a list to record what ran, in order

    def close(self) -> None:
        for worker in self._workers.values():
            worker.shutdown(wait=True)
        self._workers.clear()

    # -- running -------------------------------------------------------------------------------

    def run(self, tasks: Iterable[tuple[Action, Task]]) -> None:
        """Execute the tasks; return when all have finished; re-raise the first failure."""
        if self.inline:
            for action, task in tasks:
                self._execute(action, task, ())
            return
        last_writer: dict[Hashable, _Done] = {}
        readers: dict[Hashable, list[_Done]] = defaultdict(list)
        submitted: list[_Done] = []
        for action, task in tasks:
            deps: list[_Done] = []
            for key in task.reads:
                if key in last_writer:
                    deps.append(last_writer[key])
            for key in task.writes:
                if key in last_writer:
                    deps.append(last_writer[key])
                deps.extend(readers.pop(key, ()))
            done = _Done(future=None, queue=action.queue)
            done.future = self._workers[action.queue].submit(
                self._execute, action, task, deps, done
            )
            for key in task.reads:
                readers[key].append(done)
            for key in task.writes:
                last_writer[key] = done
            submitted.append(done)
        error = None
        for done in submitted:
            exc = done.future.exception()
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise error

    def _execute(self, action: Action, task: Task, deps, done: _Done | None = None) -> None:
        for dep in deps:
            dep.future.result()  # re-raises a failed dependency's error here
        stream = self._streams.get(action.queue) if self.on_cuda else None
        if self.on_cuda:
            for dep in deps:
                if dep.event is None:
                    continue
                if stream is not None:
                    stream.wait_event(dep.event)
                elif action.queue == "cpu":
                    dep.event.synchronize()  # this one task's work, not the whole device
        stats = self.stats[action.queue]
        if self.on_cuda and action.queue != "cpu":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
                start.record()
                with torch.inference_mode():  # thread-local: a worker thread must enter it too
                    task.run()
                end.record()
            stats.cuda_intervals.append((start, end))
            if done is not None:
                done.event = end
        else:
            t0 = time.perf_counter()
            with torch.inference_mode():
                task.run()
            stats.busy_s += time.perf_counter() - t0
        stats.tasks += 1
        stats.nbytes += task.nbytes
        if self.trace is not None:
            self.trace.append(action)

    def synchronize(self) -> None:
        """Wait for each queue's CUDA stream (one stream at a time, at a step's end, never
        inside the layer loop); nothing to wait for on a CPU."""
        if not self.on_cuda:
            return
        for stream in self._streams.values():
            if stream is not None:
                stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()

    def busy_seconds(self) -> dict[str, float]:
        """Busy seconds per queue so far (CUDA queues read from their events: call after a sync)."""
        out = {}
        for q, s in self.stats.items():
            cuda = sum(a.elapsed_time(b) for a, b in s.cuda_intervals) / 1e3
            out[q] = s.busy_s + cuda
        return out
