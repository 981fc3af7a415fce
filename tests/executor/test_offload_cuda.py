"""The offloading runtime on CUDA: streams, exact-size pinned arenas, no device-wide sync inside
the layer loop, tokens equal to the resident run. Skipped without CUDA (CI); bench/gpu_check.sh
runs it."""

from __future__ import annotations

import pytest
import torch

from executor.checkpoint import open_checkpoint
from executor.generate import generate
from executor.model import MoEModel
from executor.runtime import placed_runtime
from tests.executor.conftest import ragged_prompts
from tests.executor.test_offload import LENGTHS, SCHEDULES, STEPS, between, policy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(("schedule", "attn", "rc"), SCHEDULES)
def test_cuda_schedules_match_the_resident_run(checkpoints, monkeypatch, schedule, attn, rc):
    path = checkpoints["mixtral-single"]
    prompts = ragged_prompts(LENGTHS, seed=3)
    expected = generate(MoEModel(open_checkpoint(path, "float32")), prompts, STEPS)
    checkpoint = open_checkpoint(path, "float32")
    p = policy(attn=attn, rw=between(checkpoint.arch), rc=rc)
    runtime = placed_runtime(checkpoint, p, schedule, torch.device("cuda"))
    device_syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: device_syncs.append(a))
    try:
        out = generate(runtime, prompts, STEPS)
        store = runtime.store
        assert store.pinned, "the arenas were not pinned"
        for arena in store.arenas:  # exact size: registered, not rounded by the caching allocator
            assert arena.numel() == store.streamed_elements
        assert all(s.is_cuda for s in store.slots)
        assert runtime.engine.stats["h2d"].nbytes > 0
    finally:
        runtime.close()
    # generate waits for the device once after prefill and once at the end; never in the loop
    assert len(device_syncs) <= 2
    assert out.output_token_ids == expected.output_token_ids
