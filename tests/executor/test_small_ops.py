"""The small bf16 ops in one native pass (executor/small_ops.py) against the torch ops they
replace: rotary and the experts' combination bit for bit, RMSNorm within a bf16 rounding (its
sum of squares is added in another order), and what they do not serve left to torch. Skipped
where the kernel does not build."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import fused_moe, small_ops
from executor.layer_math import apply_rotary, rms_norm, rms_norm_fp32, rotary_tables
from executor.model import _by_token

pytestmark = pytest.mark.skipif(
    fused_moe.host_missing() is not None, reason=str(fused_moe.host_missing())
)
BF16 = torch.bfloat16


def _bf16(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 70), st.sampled_from([1, 2, 16]), st.sampled_from([64, 128]),
       st.integers(0, 2**16))  # fmt: skip
def test_rotary_is_apply_rotarys_bits(tokens, heads, dim, seed):
    x = _bf16(tokens, heads, dim, seed=seed, scale=3.0)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(seed))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    cos, sin = rotary_tables(positions, inv_freq, BF16, scaling=1.2)
    assert torch.equal(small_ops.rotary(x, cos, sin), apply_rotary(x, cos, sin))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.sampled_from([(8, 2), (64, 8), (32, 4), (4, 1)]),
       st.sampled_from([torch.float32, BF16]), st.integers(0, 2**16))  # fmt: skip
def test_combine_is_the_loops_scale_gather_and_adds(tokens, experts_k, scale_dtype, seed):
    """MoEModel.experts' torch ops over the same sorted outputs: each row scaled by its weight
    (fp32, or rounded to bf16 where the family rounds it) and rounded, a token's rows in
    expert index order added in turn."""
    experts, k = experts_k
    g = torch.Generator().manual_seed(seed)
    top_i = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    top_w = torch.rand(tokens, k, generator=g).to(scale_dtype)
    order = torch.argsort(top_i.flatten(), stable=True)
    scale = top_w.flatten().index_select(0, order)[:, None]
    ys = _bf16(tokens * k, 256, seed=seed, scale=4.0)
    source = _by_token(top_i, order)
    got = small_ops.combine(ys, scale, source, k)
    scaled = ys.clone().mul_(scale)
    by_token = scaled.index_select(0, source).view(tokens, k, -1)
    want = by_token[:, 0]
    for j in range(1, k):
        want = want + by_token[:, j]
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(1, 1024), (64, 1024), (64, 16, 128), (7, 2, 128), (3, 4096)])
def test_rms_norm_is_within_a_rounding_of_torchs(shape):
    """The same formula in fp32; the mean of squares summed in another order may move the
    normalised value across a bf16 rounding boundary, one step, which the weight's multiply and
    its own rounding carry to the output: two bf16 steps at most, and almost all equal."""
    x, w = _bf16(*shape, seed=1, scale=2.0), _bf16(shape[-1], seed=2)
    got, want = small_ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)
    step = want.float().abs().clamp(min=1e-30) * 2.0**-6  # two of bf16's relative steps
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() >= 0.99


@pytest.mark.parametrize("shape", [(1, 1024), (64, 1024), (3, 2880)])
def test_gpt_oss_rms_norm_is_within_a_rounding_of_torchs(shape):
    """gpt-oss's RMSNorm, scaled in fp32 and rounded once: as Mixtral's above, one bf16 step
    at most (the one rounding), and almost all equal."""
    x, w = _bf16(*shape, seed=5, scale=2.0), _bf16(shape[-1], seed=6)
    got, want = small_ops.rms_norm_fp32(x, w, 1e-5), rms_norm_fp32(x, w, 1e-5)
    step = want.float().abs().clamp(min=1e-30) * 2.0**-7  # one of bf16's relative steps
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() >= 0.99
    assert not torch.equal(got, small_ops.rms_norm(x, w, 1e-5))  # the other rounding differs


def test_what_the_native_ops_do_not_serve_is_torchs():
    """float32 rows, a partial rotary (GLM: cos narrower than the head), a strided view."""
    x32 = torch.randn(4, 64)
    w32 = torch.randn(64)
    assert torch.equal(small_ops.rms_norm(x32, w32, 1e-5), rms_norm(x32, w32, 1e-5))
    assert torch.equal(small_ops.rms_norm_fp32(x32, w32, 1e-5), rms_norm_fp32(x32, w32, 1e-5))
    x = _bf16(5, 2, 128, seed=3)
    cos, sin = rotary_tables(torch.arange(5), torch.rand(32), BF16)  # 64 of the 128 rotated
    assert torch.equal(small_ops.rotary(x, cos, sin), apply_rotary(x, cos, sin))
    strided = _bf16(5, 4, 128, seed=4)[:, ::2]
    cos, sin = rotary_tables(torch.arange(5), torch.rand(64), BF16)
    assert torch.equal(small_ops.rotary(strided, cos, sin), apply_rotary(strided, cos, sin))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.sampled_from([1, 3, 255, 256, 257, 1000]),
       st.sampled_from([torch.float32, BF16]), st.sampled_from(["ties", "zeros", "nan", "inf"]),
       st.integers(0, 2**16))  # fmt: skip
def test_greedy_is_torchs_first_largest(rows, vocab, dtype, special, seed):
    """small_ops.greedy against torch's max(dim=-1).indices: repeated maxima (the first wins,
    across its spans of 256), rows of +0 and -0 (equal), NaNs (the first NaN), -inf rows, and
    no rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (rows, vocab), generator=g).to(dtype)  # many ties
    picks = torch.randint(0, vocab, (rows, 2), generator=g)
    value = {"ties": 3.0, "zeros": 0.0, "nan": float("nan"), "inf": float("-inf")}[special]
    if special in ("zeros", "inf"):  # the rest below the picks: -1, or all -inf
        x = torch.full((rows, vocab), -1.0 if special == "zeros" else value, dtype=dtype)
    for r, (a, b) in enumerate(picks.tolist()):
        x[r, a], x[r, b] = (-0.0 if special == "zeros" else value), value
    assert fused_moe.ready()  # the module's skip condition built it
    assert torch.equal(small_ops.greedy(x), x.max(dim=-1).indices)
    assert torch.equal(small_ops.greedy(x[:0]), x[:0].max(dim=-1).indices)  # no rows


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_greedy_finds_the_first_across_spans(dtype):
    """The first of equal maxima in an earlier span of 256 than the largest key: -0 before +0,
    a NaN before another, a tie two spans apart."""
    x = torch.full((3, 1000), -1.0, dtype=dtype)
    x[0, 10], x[0, 300] = -0.0, 0.0
    x[1, 20], x[1, 700] = float("nan"), float("nan")
    x[2, 5], x[2, 900] = 2.0, 2.0
    assert small_ops.greedy(x).tolist() == x.max(dim=-1).indices.tolist() == [10, 20, 5]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.sampled_from([(8, 2), (64, 8), (16, 4), (4, 4), (1, 1)]),
       st.integers(0, 2**16))  # fmt: skip
def test_a_few_assignments_sort_as_torchs(tokens, experts_k, seed):
    """_assignments' Python sort of a few sequences' ids (at most SORT_IN_PYTHON) gives torch's
    stable argsort, bincount and _by_token exactly."""
    from executor.model import SORT_IN_PYTHON, _assignments

    experts, k = experts_k
    g = torch.Generator().manual_seed(seed)
    top_i = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    order, counts, source = _assignments(top_i, experts)
    want = torch.argsort(top_i.flatten(), stable=True)
    assert torch.equal(order, want)
    assert counts == torch.bincount(top_i.flatten(), minlength=experts).tolist()
    assert torch.equal(source, _by_token(top_i, want))
    assert tokens * k <= SORT_IN_PYTHON  # the Python sort ran


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.sampled_from([(8, 2), (64, 8), (16, 4), (4, 4), (1, 1)]),
       st.sampled_from([torch.float32, BF16]), st.integers(0, 2**16))  # fmt: skip
def test_dispatch_is_the_loops_sort_and_gathers(tokens, experts_k, weight_dtype, seed):
    """small_ops.dispatch against MoEModel.experts' torch ops: the rows in expert order
    (stable), their fp32 weights, combine's source and the counts, exactly."""
    experts, k = experts_k
    g = torch.Generator().manual_seed(seed)
    top_i = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    top_w = torch.rand(tokens, k, generator=g).to(weight_dtype)
    x = _bf16(tokens, 96, seed=seed)
    xs, scale, source, counts = small_ops.dispatch(x, top_w, top_i, experts)
    order = torch.argsort(top_i.flatten(), stable=True)
    assert torch.equal(xs, x.index_select(0, order // k))
    assert torch.equal(scale, top_w.flatten().index_select(0, order).float())
    assert torch.equal(source, _by_token(top_i, order))
    assert counts == torch.bincount(top_i.flatten(), minlength=experts).tolist()
