"""The executor runs the CPU GEMM path hrm.rules.cpu_gemm chose, the planner prices that same path,
and `hrm run` records it, takes --cpu-gemm and --threads, and keeps stdout valid JSONL."""

from __future__ import annotations

import dataclasses
import json

import pytest
import yaml

import executor.model
from executor.checkpoint import open_checkpoint
from executor.generate import generate
from executor.model import MoEModel
from hrm.hardware import HardwareProfile, resolve_hardware
from hrm.profiling import cpu
from hrm.rules.cpu_gemm import CpuGemmChoice, choose_cpu_gemm
from hrm.rules.gemm_paths import packing_missing
from hrm.workload import Workload
from planner.layer_seconds import micro_batch_seconds
from planner.setting import Setting
from tests.conftest import assert_one_line_error, record_flags
from tests.executor.conftest import ragged_prompts
from tests.gemm_curves import AMX, AMX_PACKED, AVX2, MIXED, scaled

ARGS = ["--prompt-len", "5", "--batch", "3", "--gen-len", "3", "--ignore-eos", "--quiet"]


def profile_with(curves, *, this_host: bool = True) -> HardwareProfile:
    """A measured CPU-only profile with these bf16 curves, claiming to be this host (or not)."""
    base = resolve_hardware("ci-cpu")
    matmul = {k: scaled(c, 1e9) for k, c in curves.items()}
    cpu_spec = dataclasses.replace(
        base.cpu,
        matmul_curves=matmul,
        peak_flops_per_s={**base.cpu.peak_flops_per_s, **{k: c.best for k, c in matmul.items()}},
    )
    facts = cpu.host_facts()
    provenance = {
        **base.provenance,
        "cpu_model": facts.cpu_model if this_host else "Some Other CPU",
        "cpu_matrix_features": list(facts.matrix_features),
        "cpu_last_level_cache_bytes": facts.last_level_cache_bytes or "unknown",
    }
    return dataclasses.replace(base, name="synthetic", cpu=cpu_spec, provenance=provenance)


def test_a_cpu_of_the_same_name_and_flags_with_another_cache_is_another_host(monkeypatch):
    """VMs hide the model: the cache size told apart two AMX Xeon VMs of one name and flags."""
    from hrm.profiling import host_gemm

    facts = dataclasses.replace(cpu.host_facts(), last_level_cache_bytes=110100480.0)
    monkeypatch.setattr(host_gemm.cpu, "host_facts", lambda: facts)
    profile = profile_with(MIXED)
    assert host_gemm.host_differs(profile) is None
    other = {**profile.provenance, "cpu_last_level_cache_bytes": 503316480}
    reason = host_gemm.host_differs(dataclasses.replace(profile, provenance=other))
    assert reason == (
        "synthetic was measured on a CPU with a 503.3 MB last-level cache; this host's is 110.1 MB"
    )
    # a profile made before the size was recorded, or on a host that does not expose it, is
    # judged by the model and flags alone
    for unknown in ("unknown", None):
        older = {**profile.provenance, "cpu_last_level_cache_bytes": unknown}
        assert host_gemm.host_differs(dataclasses.replace(profile, provenance=older)) is None


def record_paths(monkeypatch) -> list[tuple[str, int]]:
    """(path, tokens) of every GEMM the executor runs from now on."""
    calls: list[tuple[str, int]] = []
    for path in ("native", "widened", "packed"):
        inner = getattr(executor.model, f"{path}_linear")

        def recorder(x, *args, _inner=inner, _path=path, **kwargs):
            calls.append((_path, x.shape[0]))
            return _inner(x, *args, **kwargs)

        monkeypatch.setattr(executor.model, f"{path}_linear", recorder)
    return calls


CAN_PACK = pytest.mark.skipif(
    packing_missing("bfloat16") is not None, reason="this CPU has no oneDNN bf16 kernels"
)


@pytest.mark.parametrize(
    "curves",
    [AVX2, AMX, MIXED, pytest.param(AMX_PACKED, marks=CAN_PACK)],
    ids=["avx2", "amx", "mixed", "amx-packed"],
)
def test_the_executor_runs_the_path_the_planner_prices(checkpoints, monkeypatch, curves):
    profile = profile_with(curves)
    path = checkpoints["mixtral-single"]
    setting = Setting(
        arch=open_checkpoint(path).arch,
        hardware=profile,
        workload=Workload(prompt_len_mean=9, prompt_len_max=9, gen_len=3),
    )
    planned = setting.cpu_gemm_choice  # what the planner prices
    ran = choose_cpu_gemm(profile.cpu, "bfloat16", source="profile synthetic")  # as hrm run does
    assert ran == planned
    model = MoEModel(open_checkpoint(path, "bfloat16"), ran)
    calls = record_paths(monkeypatch)
    generate(model, ragged_prompts((9, 9, 9, 9, 9, 9), seed=1), 3)  # 54-token prefill, decode 6
    assert calls and all(p == planned.path_at(tokens) for p, tokens in calls)
    assert {p for p, _ in calls} == set(planned.paths)
    assert dict(model.gemm_calls) == {p: sum(q == p for q, _ in calls) for p in planned.paths}


def test_the_planner_prices_native_on_amx_and_widened_on_avx2(checkpoints):
    arch = open_checkpoint(checkpoints["mixtral-single"]).arch
    workload = Workload(prompt_len_mean=16, prompt_len_max=16, gen_len=4)

    def dense_seconds(curves, cpu_gemm=None):
        # the FFN's GEMMs alone: its elementwise passes, the same on either path, priced at ~0
        hw = profile_with(curves)
        hw = dataclasses.replace(
            hw, cpu=dataclasses.replace(hw.cpu, elementwise_rate={"bfloat16": 1e30})
        )
        setting = Setting(arch=arch, hardware=hw, workload=workload)
        if cpu_gemm is not None:
            setting = dataclasses.replace(setting, cpu_gemm=cpu_gemm)
        return float(micro_batch_seconds(setting, 16).cpu_ffn[0])

    amx_native = dense_seconds(AMX)
    amx_forced_widened = dense_seconds(
        AMX, choose_cpu_gemm(profile_with(AMX).cpu, "bfloat16", "widened")
    )
    assert amx_forced_widened > 2 * amx_native  # the slower path, priced as it would run
    avx2_widened = dense_seconds(AVX2)
    avx2_forced_native = dense_seconds(
        AVX2, choose_cpu_gemm(profile_with(AVX2).cpu, "bfloat16", "native")
    )
    assert avx2_forced_native > 2 * avx2_widened


def run_record(run_cli, checkpoint, *extra) -> tuple[dict, str]:
    status, stdout, stderr = run_cli(
        "run", "--checkpoint", checkpoint, *ARGS, *record_flags(), *extra
    )
    assert status == 0, stderr
    return json.loads(stdout), stderr


@pytest.mark.parametrize("path", ["native", "widened", pytest.param("packed", marks=CAN_PACK)])
def test_a_forced_path_is_the_one_that_ran_and_is_recorded(run_cli, checkpoints, path):
    record, _ = run_record(
        run_cli, checkpoints["mixtral-fused"], "--dtype", "bfloat16", "--cpu-gemm", path
    )
    ran = record["environment"]["cpu_gemm"]
    assert CpuGemmChoice.from_dict(ran).paths == (path,)
    assert set(ran["calls"]) == {path} and ran["calls"][path] > 0


@CAN_PACK
def test_packed_weights_are_packed_once_and_a_store_s_pages_run_native(checkpoints):
    """The model packs what it holds at load; a weight it is handed unpacked (a store's page)
    runs native, and the record counts it there."""
    import torch

    choice = CpuGemmChoice(dtype="bfloat16", buckets=((0.0, "packed"),), source="test")
    checkpoint = open_checkpoint(checkpoints["mixtral-single"], "bfloat16")
    model = MoEModel(checkpoint, choice)
    layer = model.weights.layers[0]
    assert layer.wq.is_mkldnn and layer.experts[0].w2.is_mkldnn and layer.router.is_mkldnn
    # gate and up stacked: one GEMM for both
    expert, original = layer.experts[0], checkpoint.weights.layers[0].experts[0]
    assert expert.w3 is None and expert.w1.shape == (2 * original.w1.shape[0], original.w1.shape[1])
    assert not checkpoint.weights.layers[0].wq.is_mkldnn  # the checkpoint's own stay
    x = torch.randn(3, checkpoint.arch.hidden_size, dtype=torch.bfloat16)
    assert torch.equal(model.linear(x, layer.wq), model.linear(x, checkpoint.weights.layers[0].wq))
    assert dict(model.gemm_calls) == {"packed": 1, "native": 1}
    held = MoEModel(checkpoint, choice, packs=False)
    assert not held.weights.layers[0].wq.is_mkldnn


@CAN_PACK
def test_a_taken_over_checkpoint_is_released_as_it_is_packed_but_what_is_read_stays():
    """Each original storage goes once its last matrix is packed; the embedding stays, even
    where the LM head is a view of it (a tensor-parallel rank's share of a tied head)."""
    import torch

    from executor.checkpoint import random_checkpoint
    from executor.packed_weights import packed_weights
    from hrm.arch import resolve_model

    arch = dataclasses.replace(resolve_model("mixtral-8x7b"), hidden_size=64,
                               intermediate_size=96, num_layers=2, vocab_size=128)  # fmt: skip
    weights = random_checkpoint(arch, "bfloat16").weights
    weights = dataclasses.replace(weights, lm_head=weights.embed[:64])  # a view, not the tensor
    embed = weights.embed.clone()
    norm = weights.layers[0].attn_norm
    packed = packed_weights(weights, router_linear=True, take_over=True)
    assert weights.layers[1].experts[3].w2.untyped_storage().nbytes() == 0  # released
    assert weights.layers[0].wq.untyped_storage().nbytes() == 0
    assert torch.equal(weights.embed, embed) and packed.layers[0].attn_norm is norm
    assert packed.lm_head.is_mkldnn and packed.layers[1].experts[3].w2.is_mkldnn


def test_a_packed_path_this_cpu_cannot_run_is_refused_naming_what_it_lacks(
    run_cli, checkpoints, monkeypatch, tmp_path
):
    from hrm.profiling import host_gemm
    from hrm.rules import gemm_paths

    lacks = "oneDNN's bfloat16 kernels, which need AVX-512 (AVX512-BF16 or AMX-BF16 for speed)"
    for module in (gemm_paths, host_gemm):
        monkeypatch.setattr(module, "packing_missing", lambda dtype: lacks)
    answers = tmp_path / "a.jsonl"
    status, out, err = run_cli(
        "run", "--checkpoint", checkpoints["mixtral-fused"], *ARGS, "--dtype", "bfloat16",
        "--cpu-gemm", "packed", "--output", answers,
    )  # fmt: skip
    assert_one_line_error(status, err, "--cpu-gemm packed: this CPU lacks oneDNN's bfloat16")
    assert out == "" and not answers.exists() and list(tmp_path.iterdir()) == []


def test_a_profile_of_this_host_decides_and_none_other_does(run_cli, checkpoints, tmp_path):
    checkpoint = checkpoints["mixtral-fused"]
    packs = packing_missing("bfloat16") is None
    # a host that packs needs the packed curve in its profile (here slower: the choice is mixed)
    curves = {**MIXED, "bfloat16_packed": scaled(MIXED["bfloat16"], 0.5)} if packs else MIXED
    mine = profile_with(curves).save(tmp_path / "mine.yaml")
    record, stderr = run_record(run_cli, checkpoint, "--dtype", "bfloat16", "--hardware", mine)
    assert record["environment"]["cpu_gemm"]["source"] == "profile synthetic"
    assert "probe" not in stderr
    if packs:  # one taken before the packed path was measured yields to the probe
        stale = profile_with(MIXED).save(tmp_path / "stale.yaml")
        record, stderr = run_record(run_cli, checkpoint, "--dtype", "bfloat16", "--hardware", stale)
        assert record["environment"]["cpu_gemm"]["source"].startswith("probe")
        assert "of the GEMM paths this host runs (native, widened, packed)" in stderr
    theirs = profile_with(MIXED, this_host=False).save(tmp_path / "theirs.yaml")
    record, stderr = run_record(run_cli, checkpoint, "--dtype", "bfloat16", "--hardware", theirs)
    # the probe times the model's own experts (2 layers x 4), no weights of its own
    assert record["environment"]["cpu_gemm"]["source"].startswith("probe")
    assert "over 12 of the model's experts" in record["environment"]["cpu_gemm"]["source"]
    (note,) = [line for line in stderr.splitlines() if "probe" in line]
    assert "measured on 'Some Other CPU'" in note
    warnings = [line for line in stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings
    (warning,) = warnings
    assert "Some Other CPU" in warning and "the prediction is for that host" in warning
    # a profile of this host taken before matrix features were recorded also yields to a probe
    data = yaml.safe_load(mine.read_text())
    del data["provenance"]["cpu_matrix_features"]
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(data))
    _, stderr = run_record(run_cli, checkpoint, "--hardware", tmp_path / "old.yaml")
    assert "does not record its CPU's matrix features" in stderr


def test_threads_are_set_for_the_run_and_recorded(run_cli, checkpoints):
    import torch

    before = torch.get_num_threads()
    record, _ = run_record(run_cli, checkpoints["dbrx"], "--threads", "1")
    assert record["environment"]["threads"] == 1
    assert torch.get_num_threads() == before


def test_without_output_stdout_is_jsonl_and_the_summary_goes_to_stderr(run_cli, checkpoints):
    status, stdout, stderr = run_cli("run", "--checkpoint", checkpoints["dbrx"], *ARGS)
    assert status == 0
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert len(lines) == 3 and all(len(line["output_token_ids"]) == 3 for line in lines)
    assert "tok/s" in stderr.splitlines()[-1]


def test_a_busy_machine_is_reported(run_cli, checkpoints, monkeypatch):
    import executor.run

    monkeypatch.setattr(executor.run, "measured_others_share", lambda start, end: 0.4)
    record, stderr = run_record(run_cli, checkpoints["dbrx"])
    assert "other processes took 40% of the CPU time during the run" in stderr
    assert record["environment"]["other_processes_cpu_share"] == 0.4


def test_prefill_is_its_own_phase_for_the_progress_bar(checkpoints):
    """Each step says its phase and the tokens it made: the bar's tokens a second and ETA."""
    from executor.generate import Limits

    phases: list[tuple[str, int]] = []
    model = MoEModel(open_checkpoint(checkpoints["dbrx"]))
    limits = [Limits(max_new=4), Limits(max_new=2)]
    generate(model, [[1, 2, 3], [4, 5]], 4, limits=limits, on_step=lambda *a: phases.append(a))
    assert phases == [("prefill", 2), ("decode", 2), ("decode", 1), ("decode", 1)]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--cpu-gemm", "fast"], "--cpu-gemm: unknown path 'fast'"),
        (["--threads", "0"], "--threads must be at least 1"),
    ],
)
def test_bad_cpu_options_are_one_line(run_cli, checkpoints, tmp_path, extra, fragment):
    out = tmp_path / "out.jsonl"
    status, _, err = run_cli(
        "run", "--checkpoint", checkpoints["dbrx"], *ARGS, "--output", out, *extra
    )
    assert_one_line_error(status, err, fragment)
    assert not out.exists()


def test_the_gpus_fixed_costs_are_measured_on_a_miniature_of_the_forward():
    """(Run on the CPU here: the code is the same but for the device.)"""
    from executor.overhead import measure_launch_overhead, miniature
    from tests.planner.tiny_setup import tiny_arch

    arch = tiny_arch()
    mini = miniature(arch, 3)
    assert (mini.num_layers, mini.hidden_size, mini.num_experts) == (3, 64, arch.num_experts)
    overhead = measure_launch_overhead(arch, repeats=2)
    values = (overhead.per_layer_s, overhead.per_expert_s, overhead.per_step_s)
    assert all(0 <= v < 0.1 for v in values)
    # a layer of a real forward costs something beyond its arithmetic
    assert overhead.per_layer_s + arch.experts_per_token * overhead.per_expert_s > 0


def test_small_row_counts_run_zero_padded_to_the_rows_the_choice_says(checkpoints, monkeypatch):
    """Pads of 1-3 rows to 4 (as where sgemm runs 2-3 rows as GEMVs): every GEMM of at most 3
    tokens runs at 4 rows, the rest unpadded, and the tokens are those of the unpadded run."""
    plain = CpuGemmChoice(dtype="float32", buckets=((0.0, "native"),), source="test")
    padded = dataclasses.replace(plain, small_pads={"native": {"*": {1: 4, 2: 4, 3: 4}}})
    prompts = ragged_prompts((5, 7, 6), seed=2)  # decode at 3 rows: dense and expert GEMMs pad
    checkpoint = open_checkpoint(checkpoints["mixtral-single"], "float32")
    expected = generate(MoEModel(checkpoint, plain), prompts, 3).output_token_ids
    calls: list[tuple[int, int | None]] = []
    inner = executor.model.native_linear

    def recorder(x, w, **kwargs):
        calls.append((x.shape[0], kwargs.get("rows")))
        return inner(x, w, **kwargs)

    monkeypatch.setattr(executor.model, "native_linear", recorder)
    assert generate(MoEModel(checkpoint, padded), prompts, 3).output_token_ids == expected
    assert any(tokens <= 3 for tokens, _ in calls)
    assert all(rows == (4 if tokens <= 3 else tokens) for tokens, rows in calls)


def test_the_timing_hook_adds_each_stages_time_and_changes_no_result(checkpoints, monkeypatch):
    """MoEModel.time_stages, the one hook the profilers and the by-op bench time stages with."""
    import executor.model

    prompts = [[1, 2, 3], [4, 5]]
    model = MoEModel(open_checkpoint(checkpoints["dbrx"]))
    plain = generate(model, prompts, 3).output_token_ids
    clock = iter(range(1000))
    monkeypatch.setattr(executor.model.time, "perf_counter", lambda: float(next(clock)))
    seconds: dict = {}
    model.time_stages({"linear": "gemm", "logits": "head"}, seconds, key=lambda p: ("x", p))
    calls = sum(model.gemm_calls.values())
    assert generate(model, prompts, 3).output_token_ids == plain
    # on the fake clock a call takes 1 tick plus 2 for each timed call inside it: a GEMM 1, the
    # LM head 3 (its GEMM inside), once per step
    assert seconds[("x", "gemm")] == sum(model.gemm_calls.values()) - calls > 0
    assert seconds[("x", "head")] == 3 * 3
