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
        syncs = len(device_syncs)  # closing waits for the device before it unpins
        store = runtime.store
        assert store.pinned, "the arenas were not pinned"
        for (
            arena
        ) in store.arenas.values():  # exact size: registered, not rounded by the caching allocator
            assert arena.numel() == store.streamed_elements
        assert all(s.is_cuda for s in store.slots)
        assert all(a.data_ptr() % 4096 == 0 for a in store.arenas.values())
        assert runtime.engine.stats["h2d"].nbytes > 0
        assert runtime.engine.mode == ("inline" if schedule == "serial" else "threads")
        streamed_kv = [t for mb in runtime.micro_batches for t in mb.cache.slot_major_tensors()]
        if attn and rc < 1:  # host KV crossing the link each step: pinned, slot-major
            assert streamed_kv and len(runtime.kv_pins.pinned) == len(streamed_kv)
        else:
            assert not streamed_kv
    finally:
        runtime.close()
    # generate waits for the device once after prefill and once at the end; never in the loop
    assert syncs <= 2
    assert out.output_token_ids == expected.output_token_ids
