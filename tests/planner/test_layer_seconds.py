"""micro_batch_seconds evaluates a workload of mixed answer lengths once, with a size per step:
each decode step is what a micro-batch of that step's sequences still going costs alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hrm.arch import resolve_model
from hrm.hardware import resolve_hardware
from hrm.workload import Workload
from planner.layer_seconds import ACTIVE_PARTS, micro_batch_seconds
from planner.setting import Setting


@pytest.mark.parametrize(("model", "hardware"), [("mixtral-8x7b", "l4"),
                                                 ("deepseek-v2-lite", "ci-cpu-amx")])  # fmt: skip
def test_each_decode_step_is_priced_at_the_sequences_still_going(model, hardware):
    """Answers of 1..12 tokens over 12 requests: step t runs the 12 - t still going. Each step
    of the one evaluation equals a uniform workload's step at that many sequences (the mean
    layer of a model with dense layers too), and prefill is priced at the whole micro-batch."""
    arch, hw = resolve_model(model), resolve_hardware(hardware)
    mixed = Workload.from_prompt_lens([40] * 12, 12, False, list(range(1, 13)))
    every = dataclasses.replace(mixed, gen_lens=())
    b = 24  # the micro-batch: 2 of each request's kind
    mb = micro_batch_seconds(Setting(arch=arch, hardware=hw, workload=mixed), b)
    active = np.ceil(mixed.decode_active * ACTIVE_PARTS - 1e-9) / ACTIVE_PARTS
    assert len(set(active)) == 11  # a size per step
    for step in (0, 1, 5, 11):
        share = 1.0 if step == 0 else float(active[step - 1])
        alone = micro_batch_seconds(Setting(arch=arch, hardware=hw, workload=every), b * share)
        for f in dataclasses.fields(mb):
            got, want = getattr(mb, f.name)[step], getattr(alone, f.name)[step]
            assert got == pytest.approx(want, rel=1e-12, abs=1e-18), (f.name, step)
