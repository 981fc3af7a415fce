"""The engine's own rules, on hand-made tasks: dependencies from buffers, turns on one CPU."""

from __future__ import annotations

import time

import torch

from executor.engine import Action, Engine, Task


def _timed(log: list, name: str, seconds: float):
    def run():
        start = time.perf_counter()
        time.sleep(seconds)
        log.append((name, start, time.perf_counter()))

    return run


def test_on_a_cpu_the_queues_run_inline_in_schedule_order():
    """Tasks on four queues never overlap on a CPU (the stand-in adds queues up) and run in the
    schedule's order; each queue keeps its own busy time."""
    log: list = []
    engine = Engine(torch.device("cpu"), inline=False)
    tasks = [
        (Action(0, 0, 0, "load", "h2d"), Task(_timed(log, "load", 0.05), writes=("page",))),
        (Action(0, 0, 0, "attend", "cpu"), Task(_timed(log, "attend", 0.05))),
        (Action(0, 0, 0, "store", "d2h"), Task(_timed(log, "store", 0.05))),
        (Action(0, 0, 0, "ffn", "gpu"), Task(_timed(log, "ffn", 0.05), reads=("page",))),
    ]
    try:
        engine.run(tasks)
    finally:
        engine.close()
    spans = sorted((start, end) for _, start, end in log)
    assert len(spans) == 4
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))
    assert engine.inline
    assert [name for name, _, _ in sorted(log, key=lambda r: r[1])] == [
        "load",
        "attend",
        "store",
        "ffn",
    ]
    assert all(engine.busy_seconds()[q] >= 0.05 for q in ("h2d", "cpu", "d2h", "gpu"))
    assert all(s.tasks == 1 for s in engine.stats.values())
