"""The offloading runtime in the engine's threaded and deferred modes, and the schedules' order.

`threads` runs a thread per queue on the CPU with a seeded delay before each task; `deferred`
runs device work only when the host needs it (with the seed, a random stream's oldest work also
runs early now and then). Both must give transformers' greedy tokens for every schedule, with
the weights paged through the two slots (three layers: each slot holds a different layer from
one step to the next). Dropping one declared dependency must give wrong tokens (or no buffer at
all) in `deferred`: the simulator has teeth. Each schedule's order is read from the engine's
trace.
"""

from __future__ import annotations

import pytest
import torch

from executor import tasks as task_module
from executor.checkpoint import open_checkpoint
from executor.engine import Op, Task
from executor.generate import generate
from executor.runtime import placed_runtime
from executor.schedules import WHOLE_LAYER
from tests.executor.conftest import ragged_prompts, reference_model
from tests.executor.test_matches_transformers import reference_generate
from tests.executor.test_offload import LENGTHS, SCHEDULES, STEPS, between, policy

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def transformers_tokens(checkpoints):
    cache = {}

    def tokens(name: str):
        if name not in cache:
            model = reference_model(checkpoints[name])
            cache[name] = reference_generate(model, ragged_prompts(LENGTHS, seed=3), STEPS)[0]
        return cache[name]

    return tokens


def run_placed(path, schedule: str, attn: bool, rc: float, *, trace: bool = False):
    checkpoint = open_checkpoint(path, "float32")
    p = policy(attn=attn, rw=between(checkpoint.arch), rc=rc)
    runtime = placed_runtime(checkpoint, p, schedule, CPU)
    if trace:
        runtime.engine.trace = []
    try:
        out = generate(runtime, ragged_prompts(LENGTHS, seed=3), STEPS)
    finally:
        runtime.close()
    return out.output_token_ids, runtime


@pytest.mark.parametrize("mode", ["threads", "deferred"])
@pytest.mark.parametrize("name", ["mixtral-single", "dbrx"])
@pytest.mark.parametrize(("schedule", "attn", "rc"), SCHEDULES)
def test_every_schedule_in_every_mode_matches_transformers(
    checkpoints, transformers_tokens, monkeypatch, mode, name, schedule, attn, rc
):
    monkeypatch.setenv("HRM_ENGINE", mode)
    monkeypatch.setenv("HRM_ENGINE_JITTER", "7")
    tokens, runtime = run_placed(checkpoints[name], schedule, attn, rc)
    assert runtime.engine.mode == ("inline" if (schedule, mode) == ("serial", "threads") else mode)
    assert runtime.store.streams and runtime.engine.stats["h2d"].nbytes > 0
    assert tokens == transformers_tokens(name)


def _without(op: Op, name: str):
    """The op's task builder, but its tasks no longer name the buffers called `name`."""
    original = task_module.TaskBuilder.BUILDERS[op]

    def builder(self, a, st):
        t = original(self, a, st)
        keep = lambda keys: tuple(k for k in keys if k.name != name)  # noqa: E731
        return Task(t.run, keep(t.reads), keep(t.writes), t.nbytes)

    return builder


@pytest.mark.parametrize(
    ("schedule", "op", "buffer", "why"),
    [
        ("overlap", Op.LOAD, "weight_page", "compute reads a slot before its page arrives"),
        ("serial", Op.ATTENTION, "stage_in", "CPU attention reads staging before the copy"),
        ("cgopipe", Op.POST, "attn", "post-attention reads CPU attention's output too early"),
    ],
)
def test_deferred_gives_wrong_tokens_without_one_declared_wait(
    checkpoints, transformers_tokens, monkeypatch, schedule, op, buffer, why
):
    monkeypatch.setenv("HRM_ENGINE", "deferred")
    monkeypatch.setitem(task_module.TaskBuilder.BUILDERS, op, _without(op, buffer))
    try:
        tokens, _ = run_placed(checkpoints["mixtral-single"], schedule, False, 0.0)
    except KeyError:  # the reader ran before its writer made the buffer at all
        return
    assert tokens != transformers_tokens("mixtral-single"), why


# -- the order of each schedule, from the engine's trace -------------------------------------


def _decode_layer(trace, layer: int, step: int = 1):
    return [a for a in trace if a.step == step and a.layer == layer and a.op is not Op.LOAD]


def _index(trace, step, layer, op, j=None, page=None):
    return next(
        i
        for i, a in enumerate(trace)
        if (a.step, a.layer, a.op) == (step, layer, op)
        and (j is None or a.micro_batch == j)
        and (page is None or a.page == page)
    )


@pytest.fixture(scope="module")
def traces(checkpoints):
    path = checkpoints["mixtral-single"]
    out = {}
    for schedule, attn, rc in SCHEDULES[:4]:
        _, runtime = run_placed(path, schedule, attn, rc, trace=True)
        out[schedule] = runtime.engine.trace
    return out


def test_cgopipe_interleaves_micro_batches_and_loads_page_j_after_js_attention(traces):
    trace = traces["cgopipe"]
    gpu = [(a.op, a.micro_batch) for a in _decode_layer(trace, 1) if a.queue == "gpu"]
    pre, post = Op.PRE, Op.POST
    assert gpu == [(pre, 0), (pre, 1), (post, 0), (pre, 2), (post, 1), (post, 2)]
    for j in range(1, 3):  # CPU attention of j is issued before the GPU's post of j - 1
        assert _index(trace, 1, 1, Op.ATTENTION, j) < _index(trace, 1, 1, post, j - 1)
    for j in range(3):  # page j of layer 2 comes in right after micro-batch j's D2 and post
        load = _index(trace, 1, 2, Op.LOAD, page=j)
        assert _index(trace, 1, 1, Op.ATTN_IN, j) < _index(trace, 1, 1, post, j) < load
        if j < 2:
            assert load < _index(trace, 1, 1, Op.ATTN_IN, j + 1)


def test_serial_runs_each_micro_batch_whole_after_its_layers_whole_load(traces):
    trace = traces["serial"]
    ops = [(a.op, a.micro_batch) for a in _decode_layer(trace, 1)]
    chain = [Op.PRE, Op.QKV_OUT, Op.ATTENTION, Op.ATTN_IN, Op.POST]
    assert ops == [(op, j) for j in range(3) for op in chain]
    load = _index(trace, 1, 1, Op.LOAD, page=WHOLE_LAYER)
    assert load < _index(trace, 1, 1, Op.PRE, 0)
    assert load > _index(trace, 1, 0, Op.POST, 2)  # not before the layer: no overlap


def test_overlap_copies_the_next_layer_whole_before_this_layers_work(traces):
    trace = traces["overlap"]
    load = _index(trace, 1, 2, Op.LOAD, page=WHOLE_LAYER)
    assert load < _index(trace, 1, 1, Op.PRE, 0)
    assert not any(a.op is Op.LOAD and a.page != WHOLE_LAYER for a in trace)


def test_gpu_attention_prefetches_kv_and_attends_on_the_gpu(traces):
    trace = traces["gpu-attention"]
    layer = _decode_layer(trace, 1)
    assert {a.queue for a in layer if a.op is Op.ATTENTION} == {"gpu"}
    assert not any(a.op in (Op.QKV_OUT, Op.ATTN_IN) for a in trace)
    for j in range(3):
        assert _index(trace, 1, 1, Op.KV_IN, j) < _index(trace, 1, 1, Op.ATTENTION, j)
        assert _index(trace, 1, 1, Op.ATTENTION, j) < _index(trace, 1, 1, Op.KV_OUT, j)
