"""The CPU's fused experts (executor/fused_moe.py, `--cpu-moe fused`): the grouped GEMM
against a float32 reference, every family it serves against transformers in bf16, and the runs
it cannot serve refused in one line. Skipped where the kernel does not build (no compiler):
the loop then runs, as CI's other tests check."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import executor.model
from executor import fused_moe
from executor.checkpoint import open_checkpoint
from executor.generate import generate
from executor.model import MoEModel
from hrm.rules.cpu_gemm import NAMED
from hrm.rules.gemm_paths import packing_missing
from tests.conftest import assert_one_line_error
from tests.executor.conftest import (
    _deepseek_config,
    _mixtral_config,
    _qwen_family_config,
    ragged_prompts,
    reference_model,
    save_gpt_oss,
    save_model,
    save_with_random_extras,
)
from tests.executor.test_matches_transformers import (
    TOLERANCE,
    forced,
    reference_generate,
    relative_error,
)

pytestmark = pytest.mark.skipif(
    fused_moe.host_missing() is not None, reason=str(fused_moe.host_missing())
)
# the bf16 path this host's GEMMs take beside the fused experts: packed where oneDNN has bf16
# kernels, else widened (the fused kernel's own variant follows: executor/fused_moe.py)
HOST_PATH = "packed" if packing_missing("bfloat16") is None else "widened"


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Tiny checkpoints whose expert widths are multiples of the kernel's 64: Mixtral, Qwen3-MoE,
    DeepSeek-V3 (grouped routing, a shared expert, a dense first layer) and gpt-oss (biased
    experts, a clamped GLU)."""
    root = tmp_path_factory.mktemp("fused")
    return {
        "mixtral": save_model(_mixtral_config(intermediate_size=128), root / "mixtral", seed=21),
        "qwen3_moe": save_model(
            _qwen_family_config("qwen3_moe", moe_intermediate_size=64), root / "qwen3", seed=22
        ),
        "deepseek_v3": save_with_random_extras(
            _deepseek_config("deepseek_v3", moe_intermediate_size=64), root / "v3", seed=23
        ),
        "gpt_oss": save_gpt_oss(root / "gpt_oss", seed=24, intermediate_size=128),
    }


@pytest.mark.parametrize("counts", [[0, 70, 3, 1, 2, 4, 5, 7], [16, 17, 32, 33], [301]])
@pytest.mark.parametrize("variant", ["amx", "pairs", "widened"])
def test_the_grouped_gemm_is_each_experts_gemm_rounded_to_bf16(variant, counts):
    """Rows sorted by expert, counts with an expert unhit, one past a row block (64), and 1-7
    rows (the widened form's direct path takes 4 or fewer, the pairs form's passes take 6);
    either side of the amx form's one row tile (16) and its pass (32); K past a widened chunk
    (256); or one matrix of many rows (a dense one's prefill, which the
    pairs form cuts into spans of rows): each row is its expert's x @ w.T, within a bf16
    rounding of the float32 product. Each variant where this host runs it (widened runs
    everywhere)."""
    module = fused_moe._built()
    if variant == "amx" and not module.has_amx():
        pytest.skip("no AMX-BF16 here")
    if variant == "pairs" and not module.has_pairs():
        pytest.skip("no AVX512-BF16 here")
    grouped = getattr(module, fused_moe._CALLS[variant])
    torch.manual_seed(0)
    k, n = 320, 192
    weights = [torch.randn(n, k, dtype=torch.bfloat16) * 0.1 for _ in counts]
    xs = torch.randn(sum(counts), k, dtype=torch.bfloat16)
    out = grouped(xs, counts, [fused_moe.pack(w, form=variant) for w in weights], n)
    assert out.shape == (sum(counts), n) and out.dtype == torch.bfloat16
    start = 0
    for w, c in zip(weights, counts, strict=True):
        exact = xs[start : start + c].float() @ w.float().T
        got = out[start : start + c].float()
        assert torch.allclose(got, exact, rtol=2**-7, atol=1e-3), (got - exact).abs().max()
        start += c


@pytest.mark.parametrize("counts", [[0, 70, 3, 1, 2, 4, 5, 7], [16, 17, 32, 33], [1]])
@pytest.mark.parametrize("stacked", [False, True])
def test_the_tiles_swiglu_is_the_loops_bits(counts, stacked):
    """grouped_swiglu (the amx form's gate-up call) against the loop's torch ops over the same
    call's sums: F.silu(gate) * up, bit for bit, from a gate and an up laid out apart or
    stacked in one weight; gates large enough that e^-x overflows and underflows."""
    if fused_moe.variant() != "amx":
        pytest.skip("the amx form only")
    torch.manual_seed(1)
    k, i = 320, 128
    gates = [torch.randn(i, k, dtype=torch.bfloat16) * 2 for _ in counts]
    ups = [torch.randn(i, k, dtype=torch.bfloat16) * 0.1 for _ in counts]
    if stacked:
        parts = [fused_moe.pack(torch.cat([g, u])) for g, u in zip(gates, ups, strict=True)]
    else:
        parts = [fused_moe.pack(t) for g, u in zip(gates, ups, strict=True) for t in (g, u)]
    xs = torch.randn(sum(counts), k, dtype=torch.bfloat16) * 3
    gate, up = fused_moe.grouped(xs, counts, parts, 2 * i).chunk(2, -1)
    assert gate.abs().max() > 100  # e^-x past fp32's range on the negative side
    want = torch.nn.functional.silu(gate.clone()).mul_(up)
    assert torch.equal(fused_moe.grouped_swiglu(xs, counts, parts, 2 * i), want)


@pytest.mark.parametrize("variant", ["amx", "pairs", "widened"])
def test_a_weight_in_parts_is_the_whole_weight(variant):
    """An expert's gate and up, each laid out where it was loaded, are the kernel's two parts of
    one [2I, H] weight: the same outputs, bit for bit, as the stacked weight."""
    module = fused_moe._built()
    if (variant == "amx" and not module.has_amx()) or (
        variant == "pairs" and not module.has_pairs()
    ):
        pytest.skip(f"no {variant} form here")
    grouped = getattr(module, fused_moe._CALLS[variant])
    torch.manual_seed(1)
    counts, k = [3, 0, 70], 320
    gates = [torch.randn(128, k, dtype=torch.bfloat16) for _ in counts]
    ups = [torch.randn(128, k, dtype=torch.bfloat16) for _ in counts]
    xs = torch.randn(sum(counts), k, dtype=torch.bfloat16)

    def laid(w):
        return fused_moe.pack(w, form=variant)

    pairs = list(zip(gates, ups, strict=True))
    whole = grouped(xs, counts, [laid(torch.cat(p)) for p in pairs], 256)
    parts = grouped(xs, counts, [laid(w) for p in pairs for w in p], 256)
    assert torch.equal(whole, parts)
    with pytest.raises(RuntimeError, match="counts and weights"):
        grouped(xs, counts, [laid(w) for w in gates] + [laid(ups[0])], 256)


def test_routed_experts_are_laid_out_where_they_were_loaded():
    """Taken over (a checkpoint made for this run), each routed expert's matrix is laid out over
    its own storage, as the same matrix laid out in a copy: no hole is left where it was, and
    a run's memory is its count (docs/decisions.md, 2026-12-07: packed runs' memory)."""
    from executor.checkpoint import random_checkpoint
    from executor.packed_weights import packed_weights
    from hrm.arch import resolve_model

    arch = dataclasses.replace(resolve_model("mixtral-8x7b"), hidden_size=128,
                               intermediate_size=192, num_layers=2, vocab_size=64)  # fmt: skip
    weights = random_checkpoint(arch, "bfloat16").weights
    copies = [tuple(t.clone() for t in (e.w1, e.w3, e.w2)) for w in weights.layers
              for e in w.experts]  # fmt: skip
    where = [tuple(t.data_ptr() for t in (e.w1, e.w3, e.w2)) for w in weights.layers
             for e in w.experts]  # fmt: skip
    laid = packed_weights(weights, router_linear=True, take_over=True, fused=fused_moe.pack,
                          linears=None)  # fmt: skip
    experts = [e for w in laid.layers for e in w.experts]
    assert [tuple(t.data_ptr() for t in (e.w1, e.w3, e.w2)) for e in experts] == where
    for e, originals in zip(experts, copies, strict=True):
        for got, original in zip((e.w1, e.w3, e.w2), originals, strict=True):
            assert torch.equal(got, fused_moe.pack(original))
    # not taken over: the caller's matrices are left as they were
    kept = random_checkpoint(arch, "bfloat16").weights
    before = kept.layers[0].experts[0].w2.clone()
    packed_weights(kept, router_linear=True, fused=fused_moe.pack, linears=None)
    assert torch.equal(kept.layers[0].experts[0].w2, before)


@pytest.mark.parametrize("linears", ["paths", "fused"])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_fused_experts_match_the_loop_and_transformers_in_bf16(wide, name, linears):
    """The fused call ran every routed layer (linears fused: the other matrices too, where the
    kernel's form is pairs or amx and no path was named); its bf16 logits are within
    TOLERANCE of the loop's on the same path (only the GEMMs' summation order differs), and of
    transformers' at every step where the loop's are (test_matches_transformers' check), while
    the runs chose the same tokens. The loop is the bar: on the widened path one Mixtral step
    here is 10% from transformers' bf16 in the loop too (a routing decision within a
    rounding)."""
    if linears == "fused" and fused_moe.variant() == "widened":
        pytest.skip("the other matrices go on the kernel only in its pairs and amx forms")
    path = wide[name]
    prompts = ragged_prompts((5, 9, 12), seed=5)
    source = "auto" if linears == "fused" else NAMED + HOST_PATH
    choice = dataclasses.replace(forced("bfloat16", HOST_PATH, False), source=source)
    runs, calls, models = {}, {}, {}
    for mode in ("fused", "loop"):
        model = models[mode] = MoEModel(open_checkpoint(path, "bfloat16"), choice, cpu_moe=mode)
        runs[mode] = generate(model, prompts, 8, keep_logits=True)
        calls[mode] = model.gemm_calls["fused"]
        assert model.cpu_gemm.linears == (linears if mode == "fused" else "paths")
        tiles = mode == "fused" and fused_moe.variant() == "amx" and name != "gpt_oss"
        assert model.cpu_gemm.glu == ("tiles" if tiles else "apart")  # gpt-oss's GLU: apart
    sparse = sum(w.router is not None for w in model.weights.layers)
    assert calls["loop"] == 0
    if linears == "paths":
        assert calls["fused"] == 2 * sparse * 8
    else:  # each matrix laid out for the kernel (64-multiple widths) one call a step
        weights = models["fused"].weights
        laid_out = [weights.lm_head] + [getattr(w, f.name) for w in weights.layers
                                        for f in dataclasses.fields(w)]  # fmt: skip
        laid_out += [e.w1 for w in weights.layers if w.router is None for e in w.experts]
        laid_out += [e.w2 for w in weights.layers if w.router is None for e in w.experts]
        kernel = sum(isinstance(t, fused_moe.Kernel) for t in laid_out)
        assert kernel >= 2 and calls["fused"] == 2 * sparse * 8 + 8 * kernel
        # a router narrower than a kernel block goes on it too, padded to one block
        narrow = [w.router for w in weights.layers if w.router is not None
                  and w.router.shape[0] < fused_moe.BLOCK]  # fmt: skip
        assert narrow or name != "mixtral"  # the tiny Mixtral's 8 experts
        if models["fused"].arch.routing not in executor.model.GROUP_ROUTINGS:  # else fp32, apart
            assert all(isinstance(r, fused_moe.Kernel) for r in narrow)
    fused, loop = runs["fused"], runs["loop"]
    theirs_tokens, theirs = reference_generate(reference_model(path, torch.bfloat16), prompts, 8)
    for step in range(8):
        a, b, t = fused.step_logits[step], loop.step_logits[step], theirs[step]
        assert relative_error(a, b) <= TOLERANCE["bfloat16"], f"step {step}"
        if relative_error(b, t) <= TOLERANCE["bfloat16"]:
            assert relative_error(a, t) <= TOLERANCE["bfloat16"], f"step {step}"
        seen = [[x[: step + 1] for x in r] for r in (fused.output_token_ids, theirs_tokens)]
        if seen[0] != seen[1]:
            break
    assert fused.output_token_ids == loop.output_token_ids


def test_fused_and_loop_agree_and_the_record_says_which_ran(wide, run_cli, tmp_path):
    """The same run by loop, fused and the default (auto, which fuses here): the same greedy
    tokens on these peaked checkpoints; the record names the experts' path."""
    outputs = {}
    for mode in ("loop", "fused", None):
        out = tmp_path / f"{mode}.jsonl"
        status, stdout, err = run_cli(
            "run", "--checkpoint", wide["qwen3_moe"], "--prompt-len", "7", "--batch", "3",
            "--gen-len", "5", "--dtype", "bfloat16", "--cpu-gemm", HOST_PATH,
            *(("--cpu-moe", mode) if mode else ()), "--output", out, "--json", "--quiet",
        )  # fmt: skip
        assert status == 0, err
        lines = out.read_text().splitlines()
        outputs[mode] = [json.loads(line)["output_token_ids"] for line in lines]
        record = json.loads(stdout)
        assert record["environment"]["cpu_gemm"]["experts"] == (mode or "fused")
    assert outputs["fused"] == outputs["loop"] == outputs[None]


@pytest.mark.parametrize(
    ("hardware", "noted"), [("ci-cpu-amx-l3-105mb", True), ("ci-cpu-amx", False)]
)
def test_a_fused_run_says_when_its_profile_prices_it_as_the_loop(
    wide, run_cli, tmp_path, hardware, noted
):
    """ci-cpu-amx-l3-105mb predates the kernel's curves: its prediction of a fused run is the
    loop's, and the run says so; ci-cpu-amx has them (profiled again on 2026-12-07), and the run
    says nothing of it."""
    status, stdout, err = run_cli(
        "run", "--checkpoint", wide["mixtral"], "--prompt-len", "5", "--batch", "2",
        "--gen-len", "3", "--dtype", "bfloat16", "--cpu-gemm", HOST_PATH,
        "--hardware", hardware, "--json", "--quiet", "--output", tmp_path / "out.jsonl",
    )  # fmt: skip
    assert status == 0, err
    assert json.loads(stdout)["predicted"] is not None
    says = f"note: {hardware} has no curves of the fused experts, so they are predicted at"
    assert (says in err) == noted, err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--cpu-moe", "bogus"), "--cpu-moe: unknown 'bogus'; use one of auto, loop, fused"),
        (("--cpu-moe", "fused", "--dtype", "float32"), "bfloat16 weights"),
        (("--cpu-moe", "fused", "--dtype", "bfloat16"), "a multiple of 64 (it is 96)"),
    ],
)
def test_a_fused_run_it_cannot_serve_is_one_line(checkpoints, run_cli, tmp_path, flags, says):
    """conftest's Mixtral has experts 96 wide; float32 has no fused kernel."""
    out = tmp_path / "out.jsonl"
    status, stdout, err = run_cli(
        "run", "--checkpoint", checkpoints["mixtral-single"], "--prompt-len", "4", "--batch",
        "2", "--gen-len", "2", "--cpu-gemm", "auto", *flags, "--output", out,
    )  # fmt: skip
    assert_one_line_error(status, err, says)
    assert not out.exists() and stdout == ""


def test_a_layers_fused_experts_run_as_runs_of_experts_within_the_tokens_rows(wide, monkeypatch):
    """With a run's rows bounded at one (GROUP_ROWS 1: one expert a call, the loop's transient),
    a layer's fused experts take several calls; each row's arithmetic is the one call's, so the
    logits agree (to a bf16 step where a form's blocking differs) and so do the tokens."""
    path, prompts = wide["qwen3_moe"], ragged_prompts((5, 9, 12), seed=5)

    def run():
        model = MoEModel(open_checkpoint(path, "bfloat16"), forced("bfloat16", HOST_PATH, False),
                         cpu_moe="fused")  # fmt: skip
        return generate(model, prompts, 4, keep_logits=True), model.gemm_calls["fused"]

    (whole, calls), _ = run(), monkeypatch.setattr(executor.model, "GROUP_ROWS", 1)
    cut, more = run()
    assert more > calls and cut.output_token_ids == whole.output_token_ids
    for a, b in zip(whole.step_logits, cut.step_logits, strict=True):
        assert relative_error(a, b) <= 1e-2


@pytest.mark.parametrize("width", [64, 48, 40])
@pytest.mark.parametrize("out", [128, 8, 100])
def test_a_matrix_the_hosts_form_cannot_tile_stays_native(width, out):
    """fused_linears lays a matrix out for the kernel only where its inputs fit the host's form
    (amx: 32 of K a tile, pairs: K pairs), its outputs padded to whole blocks (a router of 8);
    else it stays as it is. Either way x @ w.T within a bf16 rounding of the float32 product,
    as wide as w."""
    torch.manual_seed(2)
    w = torch.randn(out, width, dtype=torch.bfloat16)
    x = torch.randn(5, width, dtype=torch.bfloat16)
    laid = fused_moe.linear_packing(False)(w)
    assert isinstance(laid, fused_moe.Kernel) == (width % fused_moe.k_multiple() == 0)
    got = laid.times(x) if isinstance(laid, fused_moe.Kernel) else x @ laid.T
    exact = x.float() @ w.float().T
    assert got.shape == (5, out) and torch.allclose(got.float(), exact, rtol=2**-7, atol=1e-3)
