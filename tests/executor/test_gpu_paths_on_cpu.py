"""What only a GPU run would show, caught on a CPU: the GEMM path of a placed CUDA run, the order
experts are summed in, pinning through a fake CUDA runtime, and contiguous KV copies."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import executor.runtime as runtime_module
from executor import tasks as task_module
from executor.checkpoint import open_checkpoint, random_checkpoint
from executor.engine import Op
from executor.generate import generate
from executor.model import MoEModel
from executor.pinning import PAGE_BYTES, HostPins, page_aligned_empty
from executor.runtime import placed_runtime
from hrm.arch import ModelArch
from tests.executor.conftest import ragged_prompts
from tests.executor.test_offload import LENGTHS, between, policy
from tests.planner.tiny_setup import tiny_arch


class Stop(Exception):
    pass


def test_a_placed_cuda_run_takes_the_gpus_gemms_not_the_hosts(checkpoints, monkeypatch):
    """The checkpoint is loaded on the host, the layers run on the GPU: the run's device, not
    the weights', decides, so no CPU GEMM path (row padding, widening into a host scratch
    buffer) is chosen for CUDA (the review's bug 3)."""
    made = {}

    def model(*args, **kwargs):
        made["model"] = MoEModel(*args, **kwargs)
        return made["model"]

    def store(*args, **kwargs):  # a CUDA store cannot be built here; the model is made first
        raise Stop

    monkeypatch.setattr(runtime_module, "MoEModel", model)
    monkeypatch.setattr(runtime_module, "WeightStore", store)
    checkpoint = open_checkpoint(checkpoints["mixtral-single"], "bfloat16")
    with pytest.raises(Stop):
        placed_runtime(checkpoint, policy(dtype="bfloat16"), "cgopipe", torch.device("cuda"))
    assert made["model"].device.type == "cuda"
    assert made["model"].cpu_gemm is None


def _top_k_arch(k: int) -> ModelArch:
    """DBRX's routing (no renormalisation, p-norm weights) over 8 experts, k of them a token."""
    return dataclasses.replace(
        tiny_arch(num_layers=1),
        model_type="dbrx",
        num_experts=8,
        experts_per_token=k,
        norm="layernorm",
        renormalize_top_k=False,
        router_norm_p=1.0,
    )


def test_experts_are_summed_in_index_order_whatever_order_index_add_takes(monkeypatch):
    """index_add_ sums with atomics on CUDA, in any order: with top-4 (DBRX) the bf16 sum then
    differs run to run (the review's bug 7). Here index_add_ adds its rows backwards, and the
    FFN's output must not change: the K outputs are added in expert order."""
    model = MoEModel(random_checkpoint(_top_k_arch(4), "bfloat16"), device="cuda")
    w = model.weights.layers[0]
    x = torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    expected = model.experts(w, x)
    top_w, top_i = model.route(w, x)
    reference = torch.zeros_like(x)
    for e in range(8):  # transformers' loop: each expert's scaled output, in index order
        rows, slot = (top_i == e).nonzero(as_tuple=True)
        ex = w.experts[e]
        out = torch.nn.functional.silu(x[rows] @ ex.w1.T) * (x[rows] @ ex.w3.T) @ ex.w2.T
        reference[rows] += (out * top_w[rows, slot, None]).to(x.dtype)
    assert torch.equal(expected, reference)
    original = torch.Tensor.index_add_

    def backwards(self, dim, index, source, **kwargs):
        return original(self, dim, index.flip(0), source.flip(0), **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_add_", backwards)
    assert torch.equal(model.experts(w, x), expected)


class FakeCudart:
    """torch.cuda.cudart() as far as pinning calls it; refuses the registrations listed."""

    def __init__(self, refuse=()):
        self.refuse = set(refuse)
        self.calls: list[tuple[str, int]] = []
        self.registered: set[int] = set()
        self.last_error = 0

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 (the CUDA runtime's names)
        self.calls.append(("register", ptr))
        if len([c for c in self.calls if c[0] == "register"]) in self.refuse:
            self.last_error = 2
            return 2
        self.registered.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        self.registered.discard(ptr)
        return 0

    def cudaGetLastError(self):  # noqa: N802
        self.calls.append(("clear", 0))
        error, self.last_error = self.last_error, 0
        return error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 1000, 12345])
def test_arenas_start_on_a_page(dtype, numel):
    for _ in range(5):
        t = page_aligned_empty(numel, dtype)
        assert t.data_ptr() % PAGE_BYTES == 0 and t.numel() == numel and t.is_contiguous()


def test_a_refused_registration_clears_cudas_error_and_unpins_the_rest():
    """A failed cudaHostRegister leaves CUDA's last error set, and the next kernel launch
    would report it (the review's bug 4): it is cleared at once, and what was pinned is not
    left pinned."""
    cudart = FakeCudart(refuse={3})
    pins = HostPins(cudart)
    arenas = [page_aligned_empty(1000, torch.float32) for _ in range(4)]
    assert not pins.pin_all(arenas)
    assert cudart.last_error == 0
    assert cudart.calls[cudart.calls.index(("register", arenas[2].data_ptr())) + 1] == ("clear", 0)
    assert cudart.registered == set() and pins.pinned == []
    assert sum(c[0] == "register" for c in cudart.calls) == 3  # stopped at the refusal


def test_a_refusal_without_a_bound_clear_reads_the_loaded_runtimes_error():
    """torch.cuda.cudart() binds no cudaGetLastError: the error is then cleared through the
    libcudart the process loaded (none here: nothing to clear, and no failure)."""

    class Unbound(FakeCudart):
        cudaGetLastError = None  # noqa: N815

    cudart = Unbound(refuse={1})
    assert not HostPins(cudart).pin_all([page_aligned_empty(10, torch.float32)])
    assert cudart.registered == set()


def test_pins_are_undone_on_close_once():
    cudart = FakeCudart()
    pins = HostPins(cudart)
    arenas = [page_aligned_empty(1000, torch.float32) for _ in range(3)]
    assert pins.pin_all(arenas) and len(cudart.registered) == 3
    pins.close()
    pins.close()
    assert cudart.registered == set()
    assert sum(c[0] == "unregister" for c in cudart.calls) == 3


def test_a_runtime_that_fails_to_build_closes_its_store(checkpoints, monkeypatch):
    """The store's arenas are pinned when the runtime is built: a failure after it must not
    leave them registered (the review's bug 4)."""
    closed = []
    real_close = runtime_module.WeightStore.close
    monkeypatch.setattr(
        runtime_module.WeightStore, "close", lambda self: (closed.append(self), real_close(self))
    )

    def broken(self, *args, **kwargs):
        raise Stop

    monkeypatch.setattr(runtime_module.Runtime, "__init__", broken)
    checkpoint = open_checkpoint(checkpoints["mixtral-single"], "float32")
    with pytest.raises(Stop):
        placed_runtime(checkpoint, policy(), "cgopipe", torch.device("cpu"))
    assert len(closed) == 1


def test_kv_crosses_the_link_in_contiguous_copies(checkpoints, monkeypatch):
    """GPU attention over host KV copies K and V every step. From strided [B, nkv, S, D]
    slices torch would first make a pageable contiguous copy on the host, then a synchronous
    staged transfer (the review's bug 5): every copy of kv_in and kv_out is contiguous on both
    sides, and the host side starts on a page, ready to pin."""
    copies = []
    recording = []
    original = torch.Tensor.copy_

    def copy(self, src, non_blocking=False):
        if recording:
            copies.append((self.is_contiguous(), src.is_contiguous()))
        return original(self, src, non_blocking=non_blocking)

    def watched(op):
        build = task_module.TaskBuilder.BUILDERS[op]

        def builder(self, a, st):
            t = build(self, a, st)

            def run():
                recording.append(1)
                try:
                    t.run()
                finally:
                    recording.pop()

            return task_module.Task(run, t.reads, t.writes, t.nbytes)

        return builder

    for op in (Op.KV_IN, Op.KV_OUT):
        monkeypatch.setitem(task_module.TaskBuilder.BUILDERS, op, watched(op))
    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    checkpoint = open_checkpoint(checkpoints["mixtral-single"], "float32")
    p = policy(attn=True, rw=between(checkpoint.arch))
    runtime = placed_runtime(checkpoint, p, "gpu-attention", torch.device("cpu"))
    try:
        generate(runtime, ragged_prompts(LENGTHS, seed=3), 4)
        slots = [t for mb in runtime.micro_batches for t in mb.cache.slot_major_tensors()]
    finally:
        runtime.close()
    assert len(copies) > 50
    assert all(dst and src for dst, src in copies)
    assert slots and all(t.data_ptr() % PAGE_BYTES == 0 for t in slots)
