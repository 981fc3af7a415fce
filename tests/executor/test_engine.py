"""The engine's own rules on hand-made tasks: waits derived from buffers (on real threads, with
sleeping tasks), the deferred device, the modes, and the CUDA calls through a recording fake."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import torch

from executor.buffers import Buffer, attn, hidden, stage_in
from executor.engine import Action, Engine, Op, Task, engine_mode
from hrm.errors import HrmError

CPU = torch.device("cpu")


def act(queue: str, j: int = 0, op: Op = Op.PRE) -> Action:
    return Action(0, 0, j, op, queue)


def _timed(log: list, name: str, seconds: float):
    def run():
        start = time.perf_counter()
        time.sleep(seconds)
        log.append((name, start, time.perf_counter()))

    return run


def _spans(log) -> dict[str, tuple[float, float]]:
    return {name: (start, end) for name, start, end in log}


def _run(engine: Engine, tasks) -> None:
    try:
        engine.run(tasks)
        engine.synchronize()
    finally:
        engine.close()


def test_inline_runs_the_schedules_order_and_keeps_each_queues_time():
    log: list = []
    engine = Engine(CPU, mode="inline")
    names = ["load", "attend", "store", "ffn"]
    queues = ["h2d", "cpu", "d2h", "gpu"]
    _run(
        engine,
        [(act(q), Task(_timed(log, n, 0.02))) for n, q in zip(names, queues, strict=True)],
    )
    assert [name for name, _, _ in sorted(log, key=lambda r: r[1])] == names
    spans = sorted((start, end) for _, start, end in log)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert all(engine.busy_seconds()[q] >= 0.02 for q in queues)
    assert all(engine.stats[q].tasks == 1 for q in queues)
    assert engine.stats["disk"].tasks == 0 and "disk" not in engine.busy_seconds()


def test_threads_wait_for_the_writer_they_read_and_the_readers_they_overwrite():
    """Real threads, one per queue: a reader on another queue starts after its writer ends
    (read after write), a writer after the slow reader before it (write after read), and a
    task with no shared buffer overlaps them."""
    log: list = []
    a, b = Buffer("a", (0,)), Buffer("b", (0,))
    tasks = [
        (act("h2d"), Task(_timed(log, "write a", 0.15), writes=(a,))),
        (act("gpu"), Task(_timed(log, "read a", 0.15), reads=(a,))),
        (act("d2h"), Task(_timed(log, "overwrite a", 0.01), writes=(a,))),
        (act("cpu"), Task(_timed(log, "free", 0.1), writes=(b,))),
    ]
    engine = Engine(CPU, mode="threads")
    assert engine.mode == "threads"
    _run(engine, tasks)
    s = _spans(log)
    assert s["read a"][0] >= s["write a"][1]
    assert s["overwrite a"][0] >= s["read a"][1]
    assert s["free"][0] < s["write a"][1]  # ran beside the first copy: the threads are real


def test_a_failed_task_fails_the_tasks_that_wait_for_it_and_the_step():
    ran = []

    def boom():
        raise RuntimeError("copy failed")

    a = Buffer("a", (0,))
    tasks = [
        (act("h2d"), Task(boom, writes=(a,))),
        (act("gpu"), Task(lambda: ran.append("read"), reads=(a,))),
    ]
    engine = Engine(CPU, mode="threads")
    with pytest.raises(RuntimeError, match="copy failed"):
        _run(engine, tasks)
    assert ran == []


def test_an_interrupt_drops_the_queued_tasks_instead_of_waiting_for_them():
    ran = []

    def tasks():
        for i in range(20):
            yield act("gpu", i), Task(lambda i=i: (ran.append(i), time.sleep(0.1)))
        raise KeyboardInterrupt

    engine = Engine(CPU, mode="threads")
    start = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        engine.run(tasks())
    engine.close()
    assert time.perf_counter() - start < 1.0  # 20 tasks of 0.1 s would take 2
    assert len(ran) <= 3
    # but the task that was running has finished: its buffers may be freed, its pages unpinned
    assert time.perf_counter() - start >= 0.1 * len(ran) - 0.01


def test_deferred_device_work_runs_when_the_host_needs_it_and_reads_its_source_then():
    """Device work waits until a CPU task reads what it writes, or the step ends; a copy made
    without a declared wait reads what its source holds when it runs, not when issued."""
    src = torch.zeros(1)
    dst, copied = torch.zeros(1), torch.zeros(1)
    seen = []
    tasks = [
        (act("gpu"), Task(lambda: dst.fill_(1.0), writes=(hidden(0),))),
        (act("d2h"), Task(lambda: copied.copy_(src))),  # no declared wait on the write below
        (act("cpu"), Task(lambda: (seen.append(float(dst)), src.fill_(7.0)), reads=(hidden(0),))),
    ]
    engine = Engine(CPU, mode="deferred")
    engine.run(tasks)
    assert seen == [1.0]  # the CPU task made the GPU's write run first
    assert float(copied) == 0.0  # the copy has not run yet
    engine.synchronize()
    assert float(copied) == 7.0  # and read its source when it ran
    assert engine.stats["d2h"].tasks == 1


def test_deferred_runs_each_stream_in_order_and_across_streams_only_as_waits_say():
    order = []
    tasks = [
        (act("h2d", 0), Task(lambda: order.append("h2d 0"), writes=(hidden(0),))),
        (act("h2d", 1), Task(lambda: order.append("h2d 1"), writes=(hidden(1),))),
        (act("gpu", 0), Task(lambda: order.append("gpu 0"), reads=(hidden(1),))),
        (act("cpu", 0), Task(lambda: order.append("cpu"), reads=(attn(0),))),
    ]
    engine = Engine(CPU, mode="deferred")
    engine.run(tasks)
    assert order == ["cpu"]  # nothing it reads was pending
    engine.synchronize()
    assert order == ["cpu", "h2d 0", "h2d 1", "gpu 0"]


def test_with_a_seed_deferred_work_also_runs_early(monkeypatch):
    """Lazy alone never runs a copy before it is needed; with HRM_ENGINE_JITTER a random
    stream's oldest work runs early, as a GPU may run it, so a write that comes too early shows."""

    def ran_before_the_step_ended(seed: str | None) -> int:
        if seed is None:
            monkeypatch.delenv("HRM_ENGINE_JITTER", raising=False)
        else:
            monkeypatch.setenv("HRM_ENGINE_JITTER", seed)
        ran: list[int] = []
        engine = Engine(CPU, mode="deferred")
        engine.run([(act(q, j), Task(lambda j=j: ran.append(j))) for j in range(12)
                    for q in ("h2d", "gpu")])  # fmt: skip
        early = len(ran)
        engine.synchronize()
        assert len(ran) == 24
        return early

    assert ran_before_the_step_ended(None) == 0
    assert 0 < ran_before_the_step_ended("5") < 24


def test_a_seed_replays_the_same_order_in_deferred_mode(monkeypatch):
    """HRM_ENGINE_JITTER=SEED makes a failure found under one order reproducible: the same seed
    runs the same order again, another seed another one."""

    def order(seed: str) -> list[tuple[str, int]]:
        monkeypatch.setenv("HRM_ENGINE_JITTER", seed)
        engine = Engine(CPU, mode="deferred")
        engine.trace = []
        _run(engine, [(act(q, j), Task(lambda: None)) for j in range(12) for q in ("h2d", "gpu")])
        return [(a.queue, a.micro_batch) for a in engine.trace]

    assert order("5") == order("5")
    assert order("5") != order("6")


def test_deferred_on_cuda_records_each_device_task_and_the_host_waits_for_it():
    """Deferred mode on a CUDA device (one stream): a device task's end event is kept, so the
    CPU task that reads its output waits for that event, not for the whole device."""
    cuda = FakeCuda()
    engine = Engine(CPU, mode="deferred", cuda_api=cuda)
    _run(engine, [
        (act("d2h", op=Op.QKV_OUT), Task(lambda: cuda.note("copy"), writes=(stage_in(0),))),
        (act("cpu", op=Op.ATTENTION), Task(lambda: cuda.note("attend"), reads=(stage_in(0),))),
    ])  # fmt: skip
    copy_end = next(e for e in cuda.log[cuda.log.index(("copy",)) :] if e[0] == "record")
    assert cuda.log.index(("event_sync", copy_end[2])) < cuda.log.index(("attend",))


def test_link_bytes_add_up_per_queue():
    engine = Engine(CPU, mode="inline")
    tasks = [(act("h2d", j), Task(lambda: None, nbytes=n)) for j, n in enumerate((3, 4, 5))]
    _run(engine, [*tasks, (act("d2h"), Task(lambda: None, nbytes=7))])
    assert (engine.stats["h2d"].nbytes, engine.stats["d2h"].nbytes) == (12, 7)
    assert (engine.stats["h2d"].tasks, engine.stats["d2h"].tasks) == (3, 1)


def test_a_cuda_device_gets_the_cuda_side_even_inline():
    """Construction only (no CUDA here): inline on CUDA still has events for CPU tasks to wait
    on, on the current stream (no side streams)."""
    engine = Engine(torch.device("cuda"), mode="inline")
    assert engine.cuda is not None and all(s is None for s in engine.cuda.streams.values())
    assert Engine(CPU, mode="inline").cuda is None


def test_a_serial_schedule_runs_inline_in_threads_mode_and_on_one_stream_when_deferred():
    assert Engine(CPU, serial=True, mode="threads").mode == "inline"
    order = []
    tasks = [
        (act("h2d"), Task(lambda: order.append("copy"))),
        (act("gpu"), Task(lambda: order.append("compute"), writes=(stage_in(0),))),
        (act("cpu"), Task(lambda: order.append("attend"), reads=(stage_in(0),))),
    ]
    engine = Engine(CPU, serial=True, mode="deferred")
    engine.run(tasks)
    assert order == ["copy", "compute", "attend"]  # one stream: the copy went first


def test_a_key_that_is_not_a_buffer_is_refused():
    engine = Engine(CPU, mode="inline")
    with pytest.raises(TypeError, match="executor.buffers"):
        engine.run([(act("gpu"), Task(lambda: None, reads=(("stage_in", 0),)))])


@pytest.mark.parametrize(
    ("value", "device", "expected"),
    [
        ("", "cpu", "inline"),
        ("", "cuda", "threads"),
        ("threads", "cpu", "threads"),
        ("deferred", "cpu", "deferred"),
        ("threads", "cuda", "threads"),
        ("inline", "cuda", "inline"),
    ],
)
def test_the_mode_comes_from_hrm_engine(monkeypatch, value, device, expected):
    monkeypatch.setenv("HRM_ENGINE", value)
    assert engine_mode(torch.device(device)) == expected


@pytest.mark.parametrize(
    ("value", "device", "message"),
    [
        ("fast", "cpu", "HRM_ENGINE='fast' is not an engine mode; use one of inline, threads, "
         "deferred or leave it unset"),
        ("Threads", "cpu", "HRM_ENGINE='Threads' is not an engine mode; use one of inline, "
         "threads, deferred or leave it unset"),
        ("deferred", "cuda", "HRM_ENGINE=deferred simulates an asynchronous GPU on a CPU; a CUDA "
         "run runs on real streams: unset HRM_ENGINE or use threads"),
    ],
)  # fmt: skip
def test_a_bad_hrm_engine_is_one_clear_error(monkeypatch, value, device, message):
    """The whole line: what is wrong and what to do."""
    monkeypatch.setenv("HRM_ENGINE", value)
    with pytest.raises(HrmError) as error:
        engine_mode(torch.device(device))
    assert str(error.value) == message


def test_the_jitter_delays_each_threaded_task_by_the_same_seeded_amount(monkeypatch):
    """HRM_ENGINE_JITTER=SEED: a delay before every task in threads mode, the same for the
    same seed and action whatever thread runs it; none without a seed."""
    import executor.engine as engine_module

    def delays(seed: str | None) -> list[float]:
        slept = []
        monkeypatch.setattr(engine_module.time, "sleep", slept.append)
        if seed is None:
            monkeypatch.delenv("HRM_ENGINE_JITTER", raising=False)
        else:
            monkeypatch.setenv("HRM_ENGINE_JITTER", seed)
        _run(Engine(CPU, mode="threads"), [(act("gpu", j), Task(lambda: None)) for j in range(5)])
        return slept

    first, again, other = delays("3"), delays("3"), delays("4")
    assert len(first) == 5 and all(0 < d <= engine_module.JITTER_MAX_S for d in first)
    assert first == again and first != other
    assert delays(None) == []


def test_a_mode_given_in_code_is_checked_too():
    with pytest.raises(HrmError, match="engine mode 'fast': use one of inline, threads, deferred"):
        Engine(CPU, mode="fast")


def test_a_bad_jitter_seed_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HRM_ENGINE_JITTER", "often")
    with pytest.raises(HrmError, match="integer seed"):
        Engine(CPU, mode="threads")


# -- CUDA's calls, through a recording fake of torch.cuda ------------------------------------


class FakeCuda:
    """The part of torch.cuda the engine calls, recording every call in order."""

    def __init__(self, device=CPU):
        self.device = device
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.default = self.Stream(None, name="default")
        self.local = threading.local()
        self.streams = 0

    def note(self, *entry) -> None:
        with self.lock:
            self.log.append(entry)

    def Stream(self, device, name=None):  # noqa: N802 (torch.cuda's name)
        cuda = self

        class Stream:
            def __init__(self):
                self.name = name or f"s{cuda.streams}"

            def wait_event(self, event):
                cuda.note("wait_event", self.name, event.name)

            def wait_stream(self, other):
                cuda.note("wait_stream", self.name, other.name)

            def synchronize(self):
                cuda.note("stream_sync", self.name)

        if name is None:
            self.streams += 1
        return Stream()

    def Event(self, enable_timing=False):  # noqa: N802
        cuda = self

        class Event:
            def __init__(self):
                self.name, self.timing = None, enable_timing is True

            def record(self):
                self.name = f"e{len(cuda.log)}"
                cuda.note("record", cuda.current_stream(cuda.device).name, self.name)

            def synchronize(self):
                cuda.note("event_sync", self.name)

            def elapsed_time(self, end):
                """2 ms, as CUDA only between two recorded events made with timing."""
                assert self.timing and end.timing and self.name and end.name
                assert int(end.name[1:]) > int(self.name[1:])
                return 2.0

        return Event()

    def current_stream(self, device=None):
        assert device == self.device, "the engine's device, not the current one"
        return getattr(self.local, "stream", self.default)

    @contextmanager
    def stream(self, s):
        before = self.current_stream(self.device)
        self.local.stream = s
        try:
            yield
        finally:
            self.local.stream = before


def test_an_inline_cpu_task_waits_for_the_device_work_it_reads():
    """Inline on CUDA (the serial schedule) the device's copies are still asynchronous: CPU
    attention must wait for the event of the copy that fills its staging, or it reads it
    half-filled (the review's bug 1)."""
    cuda = FakeCuda()
    engine = Engine(CPU, serial=True, mode="threads", cuda_api=cuda)
    tasks = [
        (act("d2h", op=Op.QKV_OUT), Task(lambda: cuda.note("copy"), writes=(stage_in(0),))),
        (act("cpu", op=Op.ATTENTION), Task(lambda: cuda.note("attend"), reads=(stage_in(0),))),
    ]
    _run(engine, tasks)
    copy_end = next(e for e in cuda.log[cuda.log.index(("copy",)) :] if e[0] == "record")
    assert copy_end[1] == "default"  # inline: the current stream, no side streams
    assert cuda.log.index(("event_sync", copy_end[2])) < cuda.log.index(("attend",))
    assert all(s is None for s in engine.cuda.streams.values())


def test_every_queue_stream_waits_for_the_default_stream_at_each_step():
    """Side streams do not wait for the default stream, where sampling wrote the tokens the
    next step embeds (the review's bug 2): each step starts with wait_stream on each of them."""
    cuda = FakeCuda()
    engine = Engine(CPU, mode="threads", cuda_api=cuda)
    try:
        for step in range(2):
            cuda.note("step", step)
            engine.run([(Action(step, 0, 0, Op.EMBED, "h2d"), Task(lambda: None))])
            engine.synchronize()
    finally:
        engine.close()
    for step in range(2):
        start = cuda.log.index(("step", step))
        first_record = next(i for i, e in enumerate(cuda.log) if i > start and e[0] == "record")
        waits = {e[1] for e in cuda.log[start:first_record] if e[0] == "wait_stream"}
        assert waits == {"s1", "s2", "s3"}
        assert all(e[2] == "default" for e in cuda.log[start:first_record] if e[0] == "wait_stream")


def test_device_timing_events_are_folded_into_busy_time_at_each_synchronize():
    """Two events per task are read and dropped at each step's end, not kept for the whole
    run (the review's bug 6)."""
    cuda = FakeCuda()
    engine = Engine(CPU, mode="threads", cuda_api=cuda)
    try:
        for step in range(3):
            engine.run([(Action(step, 0, j, Op.PRE, "gpu"), Task(lambda: None)) for j in range(4)])
            engine.synchronize()
            assert all(not intervals for intervals in engine.cuda.intervals.values())
    finally:
        engine.close()
    assert engine.busy_seconds()["gpu"] == pytest.approx(3 * 4 * 2.0e-3)
    assert engine.stats["gpu"].tasks == 12


def test_a_device_task_waits_on_its_own_stream_for_the_events_it_depends_on():
    """Threads on CUDA: the compute stream waits for the copy stream's event of the page it
    reads, and records its own start and end on its own stream; the step's synchronize waits
    for every stream, then the default one."""
    cuda = FakeCuda()
    engine = Engine(CPU, mode="threads", cuda_api=cuda)
    streams = {q: s.name for q, s in engine.cuda.streams.items()}
    page = Buffer("weight_page", (0, 0))
    try:
        engine.run(
            [
                (act("h2d", op=Op.LOAD), Task(lambda: cuda.note("copy"), writes=(page,))),
                (act("gpu"), Task(lambda: cuda.note("compute"), reads=(page,))),
            ]
        )
        cuda.note("step end")
        engine.synchronize()
    finally:
        engine.close()
    log = cuda.log
    copy_records = [e for e in log[: log.index(("copy",)) + 2] if e[0] == "record"]
    assert [e[1] for e in copy_records] == [streams["h2d"]] * 2
    copy_end = copy_records[-1][2]
    wait = log.index(("wait_event", streams["gpu"], copy_end))
    compute = log.index(("compute",))
    assert wait < compute
    assert [e[1] for e in log[wait:compute] if e[0] == "record"] == [streams["gpu"]]
    end = log.index(("step end",))
    synced = [e[1] for e in log[end:] if e[0] == "stream_sync"]
    assert sorted(synced[:3]) == sorted(streams.values()) and synced[3] == "default"
