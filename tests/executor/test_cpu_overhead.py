"""The CPU's fixed costs, timed on the executor's decode at the model's own shapes with what the
planner prices elsewhere taken out (executor/cpu_overhead.py)."""

from __future__ import annotations

import time

import pytest
import torch

import executor.model
from executor import cpu_overhead
from hrm.rules.cpu_gemm import CpuGemmChoice
from tests.planner.tiny_setup import tiny_arch

NATIVE = CpuGemmChoice(dtype="float32", buckets=((0.0, "native"),), source="test")
FAST_ELEMENTWISE = 1e15  # elements/s: charges next to nothing


def _measure(elementwise_rate: float = FAST_ELEMENTWISE, rounds: int = 1):
    preset = cpu_overhead.Preset(
        rounds=rounds, decode_steps=6, dtypes=("float32",), elementwise_repeats=1
    )
    return cpu_overhead.measure_cpu_overhead(
        tiny_arch(), "float32", cpu_gemm=NATIVE, elementwise_rate=elementwise_rate, preset=preset
    )


def _slowed(monkeypatch, name: str, delay_s: float) -> None:
    """Make executor.model's `name` take `delay_s` longer per call."""
    original = getattr(executor.model, name)

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return original(*args, **kwargs)

    monkeypatch.setattr(executor.model, name, slow)


@pytest.mark.parametrize(
    ("part", "calls_per_layer", "delay_s"),
    [("native_linear", 11, 4e-3), ("append_and_attend", 1, 20e-3)],
)
def test_the_gemms_and_the_attention_stage_are_taken_out(
    monkeypatch, part, calls_per_layer, delay_s
):
    """Each GEMM call and each decode-attention stage is priced by its own curve, so time added
    to them must not show up as fixed cost. A layer of the tiny model makes at least 11 GEMM
    calls (q, k, v, o, router, two experts' three) and one attention stage: left in, the delay
    would add at least calls x delay to a layer at batch 1. Taken out, what remains is the cost
    of the ops after a pause (threads woken, caches cold), far less. The median of three rounds:
    one 20-30 ms hiccup of a busy VM in a single round would pass for fixed cost."""
    _slowed(monkeypatch, part, delay_s)
    # what is taken out is checked here, not whether the rounds settle (a loaded host's do not)
    fit = cpu_overhead.settled_fit
    monkeypatch.setattr(cpu_overhead, "settled_fit", lambda arch, s: (fit(arch, s)[0], ""))
    overhead = _measure(rounds=3)
    k = tiny_arch().experts_per_token
    assert 0 <= overhead.per_layer_s + k * overhead.per_expert_s < calls_per_layer * delay_s / 2


def test_the_elementwise_passes_the_planner_charges_are_taken_out():
    """At a rate of 1000 elements/s the charged passes dwarf any real step: nothing is left."""
    overhead = _measure(elementwise_rate=1e3)
    assert (overhead.per_layer_s, overhead.per_expert_s, overhead.per_step_s) == (0, 0, 0)


def test_a_decode_costs_something_beyond_its_priced_parts():
    overhead = _measure()
    assert overhead.per_step_s + overhead.per_layer_s + overhead.per_expert_s > 0


def test_weights_take_the_models_shapes_and_experts_cycle_through_the_cap(monkeypatch):
    arch = tiny_arch(num_layers=2)  # 4 experts of h=64, i=128: 96 KiB each in float32
    monkeypatch.setattr(cpu_overhead, "EXPERT_BYTES_CAP", 3 * 3 * 64 * 128 * 4)
    weights = cpu_overhead.shaped_weights(arch, torch.float32)
    assert weights.embed.shape == weights.lm_head.shape == (arch.vocab_size, arch.hidden_size)
    experts = [e for layer in weights.layers for e in layer.experts]
    assert len(experts) == 8 and len({id(e) for e in experts}) == 3  # three distinct sets
    assert experts[0] is experts[3] and experts[1] is not experts[0]
    first = experts[0]
    assert (first.w1.shape, first.w2.shape) == ((128, 64), (64, 128))
    assert weights.layers[0].wq.shape == (arch.num_attention_heads * arch.head_dim, 64)
    # the sequences' tokens embed apart and the router is random: routing spreads
    assert len({tuple(row.tolist()) for row in weights.embed[:64]}) == 64
    assert not torch.equal(weights.layers[0].router[0], weights.layers[0].router[1])


def _rests(arch, per_step: float, per_layer: float, per_expert: float) -> dict:
    """rest(L, b) of the module docstring for these fixed costs."""
    from hrm.roofline.ops import expected_distinct_experts

    return {
        (layers, batch): per_step
        + layers * (per_layer + expected_distinct_experts(arch, batch) * per_expert)
        for layers in cpu_overhead.LAYERS
        for batch in cpu_overhead.BATCHES
    }


def test_a_settled_fit_says_how_sure_each_figure_is():
    arch = tiny_arch()
    rounds = [_rests(arch, 300e-6, 50e-6, 100e-6), _rests(arch, 310e-6, 52e-6, 104e-6)]
    samples = {key: [r[key] for r in rounds] for key in rounds[0]}
    overhead, problem = cpu_overhead.settled_fit(arch, samples)
    assert problem == ""
    assert overhead.per_expert_s == pytest.approx(102e-6)
    assert overhead.spread["per_expert_s"] == pytest.approx(4e-6)
    assert overhead.spread["per_layer_s"] == pytest.approx(2e-6)


def test_a_fit_whose_rounds_disagree_is_remeasured_then_refused(monkeypatch):
    """A loaded 2-core host fitted 48 ms per expert touched (idle CPUs: 70-160 us): one round
    at 100 us, one with the sequences' experts slowed 500x, is noise, not a cost."""
    from hrm.errors import HrmError

    arch = tiny_arch()
    quiet, loaded = _rests(arch, 300e-6, 50e-6, 100e-6), _rests(arch, 300e-6, 50e-6, 50e-3)
    _, problem = cpu_overhead.settled_fit(arch, {key: [quiet[key], loaded[key]] for key in quiet})
    assert problem.startswith("per expert came out")
    calls = []

    def sampler(model, priced, batch, rate, steps):
        def sample():
            calls.append(batch)
            key = (model.arch.num_layers, batch)
            return (loaded if (len(calls) - 1) // 4 % 2 else quiet)[key]  # rounds alternate

        return sample

    monkeypatch.setattr(cpu_overhead, "_rest_sampler", sampler)
    with pytest.raises(HrmError, match="fixed costs in float32 did not settle in 2 tries"):
        _measure(rounds=2)
    assert len(calls) == cpu_overhead.ATTEMPTS * 2 * 4  # re-measured once, then refused
