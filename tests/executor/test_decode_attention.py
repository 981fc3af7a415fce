"""The native decode attention of AMX hosts (executor/decode_attention.cpp, attention.native_decode)
against an fp32 product: as near it as torch's SDPA at every shape it serves (ragged keys, a
padding mask, the cache's strided rows), masked keys given no weight, what it does not serve left
to SDPA, and a fused bf16 model's decode steps through it, static and continuous, within the
suite's tolerance of the same runs by SDPA. Skipped where the host has no AMX or the kernel does not
build."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor import attention, small_ops
from executor.checkpoint import open_checkpoint
from executor.generate import Limits, generate
from executor.model import MoEModel
from executor.passes import run_passes
from executor.runtime import Runtime
from tests.executor.conftest import _mixtral_config, ragged_prompts, reference_model, save_model
from tests.executor.test_matches_transformers import TOLERANCE, reference_generate, relative_error

pytestmark = pytest.mark.skipif(
    not small_ops.amx_attention(), reason="no AMX-BF16 here, or the kernel did not build"
)
BF16 = torch.bfloat16


def _case(batch, nkv, g, d, dv, keys, spare, hidden, seed):
    """q [B, nkv, g, d]; keys and values views of a longer cache (`spare` slots past `keys`);
    a mask hiding the first hidden[b] keys of sequence b (None where none are hidden)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return (torch.randn(*shape, generator=gen) * 2).to(BF16)

    q = draw(batch, nkv, g, d)
    k, v = draw(batch, nkv, keys + spare, d), draw(batch, nkv, keys + spare, dv)
    mask = None
    if any(hidden):
        slots = torch.arange(keys)
        mask = (slots[None, :] >= torch.tensor(hidden)[:, None]).view(batch, 1, 1, keys)
    return q, k[:, :, :keys], v[:, :, :keys], mask


def _fp32(q, k, v, mask, scale):
    scores = q.float() @ k.float().transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v.float()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.sampled_from([1, 2, 4, 8, 16]),
       st.sampled_from([(32, 32), (64, 64), (128, 128), (64, 128), (128, 256)]),
       st.integers(1, 200), st.integers(0, 20), st.data(), st.integers(0, 2**16))  # fmt: skip
def test_it_is_as_near_the_fp32_product_as_sdpa(batch, nkv, g, widths, keys, spare, data, seed):
    d, dv = widths
    hidden = data.draw(st.lists(st.integers(0, keys - 1), min_size=batch, max_size=batch))
    q, k, v, mask = _case(batch, nkv, g, d, dv, keys, spare, hidden, seed)
    scale = d**-0.5
    assert small_ops.serves_decode(q, k, v, mask)
    want = _fp32(q, k, v, mask, scale)
    got = attention.native_decode(q, k, v, mask)
    theirs = attention.sdpa_decode(q, k, v, mask)
    assert got.dtype == BF16 and got.shape == (batch, nkv, g, dv)
    # SDPA's error and one more rounding of the largest output to bf16 (each rounds its sums,
    # from products in another order, at the end: half a step either way)
    bar = (theirs.float() - want).abs().max().item() + want.abs().max().item() * 2**-8
    assert (got.float() - want).abs().max().item() <= bar


def test_masked_keys_get_no_weight():
    """Hidden keys whose values are huge change nothing: each sequence's output is its visible
    keys' attention alone."""
    q, k, v, _ = _case(3, 2, 4, 64, 64, 40, 0, (0, 0, 0), seed=1)
    hidden = (0, 17, 39)
    mask = (torch.arange(40)[None, :] >= torch.tensor(hidden)[:, None]).view(3, 1, 1, 40)
    loud = v.clone()
    for b, n in enumerate(hidden):
        loud[b, :, :n] = 3e4
    got = attention.native_decode(q, k, loud, mask)
    for b, n in enumerate(hidden):
        alone = attention.native_decode(
            q[b : b + 1], k[b : b + 1, :, n:], v[b : b + 1, :, n:], None
        )
        assert relative_error(got[b : b + 1].float(), alone.float()) <= 1e-2


@pytest.mark.parametrize(
    "what", ["three query rows", "a width of 80", "fp32", "an additive mask", "a key width of 256"]
)
def test_what_it_does_not_serve_is_sdpas(what):
    g, d, dtype = {"three query rows": (3, 64, BF16), "a width of 80": (4, 80, BF16),
                   "fp32": (4, 64, torch.float32), "an additive mask": (4, 64, BF16),
                   "a key width of 256": (4, 256, BF16)}[what]  # fmt: skip
    q, k, v, mask = _case(2, 2, g, d, d, 9, 0, (0, 3), seed=2)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if what == "an additive mask":
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    assert not small_ops.serves_decode(q, k, v, mask)
    assert torch.equal(attention.native_decode(q, k, v, mask), attention.sdpa_decode(q, k, v, mask))


@pytest.fixture(scope="module")
def heads_of_32(tmp_path_factory):
    """A tiny Mixtral whose heads are 32 wide (the kernel's least), experts 64-multiples."""
    config = _mixtral_config(hidden_size=128, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2)  # fmt: skip
    return save_model(config, tmp_path_factory.mktemp("heads32") / "mixtral", seed=31)


def test_a_bf16_model_decodes_through_it(heads_of_32, monkeypatch):
    """Every decode step of a fused bf16 model on the CPU, static or continuous, runs the native
    kernel, and a loop model's or a float32 one's never; the fused run's logits are within the
    suite's tolerance of the same run's with SDPA, and of transformers' wherever SDPA's are,
    with the same tokens."""
    calls = []
    native = small_ops.decode_attention
    monkeypatch.setattr(small_ops, "decode_attention", lambda *a: calls.append(1) or native(*a))
    prompts = ragged_prompts((5, 9, 12), seed=6)
    _, theirs = reference_generate(reference_model(heads_of_32, BF16), prompts, 6)
    for mode in ("loop", "fused"):
        runs = {}
        for kernel in ("native", "sdpa"):
            if kernel == "sdpa":  # the same run with torch's kernel in the native one's place
                monkeypatch.setitem(attention.DECODE_KERNELS, "native", attention.sdpa_decode)
            model = MoEModel(open_checkpoint(heads_of_32, "bfloat16"), cpu_moe=mode)
            before = len(calls)
            runs[kernel] = generate(model, prompts, 6, keep_logits=True)
            steps = 5 * model.arch.num_layers if kernel == "native" and mode == "fused" else 0
            assert len(calls) - before == steps
            monkeypatch.setitem(attention.DECODE_KERNELS, "native", attention.native_decode)
        for step in range(6):
            ours, sdpa = runs["native"].step_logits[step], runs["sdpa"].step_logits[step]
            assert relative_error(ours, sdpa) <= TOLERANCE["bfloat16"], f"{mode} step {step}"
            if relative_error(sdpa, theirs[step]) <= TOLERANCE["bfloat16"]:
                assert relative_error(ours, theirs[step]) <= TOLERANCE["bfloat16"]
        assert runs["native"].output_token_ids == runs["sdpa"].output_token_ids
    before, out = len(calls), {}
    limits = {i: Limits(max_new=6) for i in range(3)}
    run_passes(
        Runtime(model, schedule="serial", micro_batch_size=2, attention_on_gpu=True,
                continuous=True), dict(enumerate(prompts)), limits, max_running=3,
        token_budget=32, total_blocks=64, on_finish=lambda i, ids, _: out.update({i: ids}),
    )  # fmt: skip
    assert len(calls) > before
    assert [list(out[i]) for i in range(3)] == runs["native"].output_token_ids
    before = len(calls)
    generate(MoEModel(open_checkpoint(heads_of_32, "float32")), prompts, 3)
    assert len(calls) == before


def test_its_host_has_the_bf16_decode_curve_of_the_kernel():
    """What `hrm profile` times a fused bf16 model's decode attention by: the native kernel
    here, torch's elsewhere (fp32)."""
    from hrm.arch import ModelArch

    config = _mixtral_config(hidden_size=128, intermediate_size=128).to_dict()
    arch = ModelArch.from_hf_config(config)
    assert attention.decode_kernel(arch, "bfloat16") == "native"
    assert attention.decode_kernel(arch, "float32") is None
