"""hrm profile's measuring code on the CPU: timing loop, sweep budget, shapes, a tiny real run."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import pytest

from hrm import units
from hrm.arch import resolve_model
from hrm.hardware import HardwareProfile
from hrm.hardware.parts import gemm_shape_key
from hrm.profiling import GENERIC_SHAPES, SweepPlan, measure_profile
from hrm.profiling.cpu import CpuTimes, measured_others_share, others_cpu_share
from hrm.profiling.matmul import GemmShape, fit_shape, sweep_matmul
from hrm.profiling.timing import Timing, time_calls
from hrm.roofline.ops import gemm_shapes
from hrm.rules.gemm_paths import packing_missing

TINY_PLAN = SweepPlan(
    name="tiny",
    tokens_grid=(1, 8, 64),
    repeats=3,
    min_sample_s=0.002,
    matmul_budget_s=3.0,
    min_array_bytes=64e6,
    link_sizes_bytes=(1e6, 8e6),
    both_directions_bytes=8e6,
    device_copy_bytes=64e6,
    shape_tokens_grid=(1, 8),
    shape_budget_s=1.0,
)
# Mixtral's geometry with small expert matrices, so a real sweep takes a second or two.
TINY_ARCH = dataclasses.replace(
    resolve_model("mixtral-8x7b"), name="tiny-mixtral", hidden_size=512, intermediate_size=1024
)


def test_importing_the_profile_command_does_not_load_torch():
    code = "import sys, hrm.cli, hrm.cli.profile, hrm.profiling; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_timing_takes_the_median_and_keeps_the_spread():
    timing = Timing(samples_s=(2.0, 1.0, 4.0), calls_per_sample=1)
    assert timing.median_s == 2.0
    assert timing.rate(10.0) == 5.0
    assert timing.rate_range(8.0) == (2.0, 8.0)
    assert timing.relative_spread == 1.5


def test_time_calls_warms_up_then_samples_enough_calls():
    seen = []

    def clock(fn, calls):
        seen.append(calls)
        return 0.001 * calls  # 1 ms per call

    timing = time_calls(lambda: None, clock=clock, repeats=4, min_sample_s=0.01)
    assert seen == [1, 10, 10, 10, 10]  # one warm-up call, then samples of 10 calls
    assert timing.calls_per_sample == 10
    assert timing.median_s == pytest.approx(0.001)


def test_fit_shape_keeps_the_model_size_when_it_fits_and_halves_when_not():
    arch = resolve_model("mixtral-8x7b")
    full = fit_shape(arch, max_tokens=4096, memory_budget_bytes=1e12)
    assert (full.hidden, full.intermediate, full.scale) == (4096, 14336, 1.0)
    small = fit_shape(arch, max_tokens=4096, memory_budget_bytes=100e6)
    assert small.scale < 1.0
    assert small.hidden % 64 == 0 and small.intermediate % 64 == 0
    assert small.buffer_bytes(4096, 4) <= 100e6
    assert "scaled" in small.describe()


def tiny_sweep(clock, *, tokens_grid, repeats, budget_s, dtype="float32", tick=lambda: None):
    """sweep_matmul on a 64x64 CPU GEMM with a fake clock and no minimum sample length."""
    return sweep_matmul(
        dtype=dtype,
        shape=GemmShape(model="t", hidden=64, intermediate=64),
        tokens_grid=tokens_grid,
        device="cpu",
        clock=clock,
        repeats=repeats,
        min_sample_s=0.0,
        budget_s=budget_s,
        tick=tick,
    )


def test_sweep_stops_before_a_point_that_would_overrun_its_budget():
    ticks = []

    def slow_clock(fn, calls):
        fn()
        return 0.5 * calls  # pretend every call takes half a second

    sweep = tiny_sweep(
        slow_clock, tokens_grid=(1, 2, 4), repeats=2, budget_s=1.0, tick=lambda: ticks.append(1)
    )
    assert [tokens for tokens, _ in sweep.points] == [1]
    assert "stopped before 2 tokens" in sweep.stopped
    assert len(ticks) == 3  # the progress bar still reaches the end


def test_sweep_takes_its_samples_in_rounds_over_the_points():
    """Warm-up and first sample of each point in turn, then one sample of every point per round:
    a host that slows down for one stretch costs each point one sample, not all of one point's."""
    seen = []

    def clock(fn, calls):
        seen.append((fn.args[0].shape[0], calls))
        slowdown = 2.0 if 6 <= len(seen) <= 8 else 1.0  # the 6th to 8th calls run at half speed
        return 1e-3 * calls * slowdown

    sweep = tiny_sweep(clock, tokens_grid=(1, 4, 16), repeats=3, budget_s=10.0)
    # (tokens, calls): warm-up and first sample per point, then two rounds over all three
    first_pass = [(1, 1), (1, 1), (4, 1), (4, 1), (16, 1), (16, 1)]
    assert seen == first_pass + [(1, 1), (4, 1), (16, 1)] * 2
    # the slow stretch (calls 6-8: 16's first sample, then 1's and 4's second) costs each of
    # those points one of three samples, so every median is the fast 1 ms
    assert [t for t, _ in sweep.points] == [1, 4, 16]
    assert all(timing.median_s == pytest.approx(1e-3) for _, timing in sweep.points)
    assert [max(t.samples_s) for _, t in sweep.points] == pytest.approx([2e-3] * 3)


def test_sweep_counts_the_later_rounds_in_its_budget():
    # each call 0.25 s: point 1 costs 0.5 s now and owes 2 x 0.25 s; point 2 would take about
    # 0.5 + 3 x 0.5 = 2 s: 0.5 owed + 2 > 2 s of budget, so it is left out (without what is
    # owed, 2 s would just fit)
    sweep = tiny_sweep(lambda fn, calls: 0.25 * calls, tokens_grid=(1, 2), repeats=3, budget_s=2.0)
    assert [t for t, _ in sweep.points] == [1]
    assert "0.5 s owed to the later rounds" in sweep.stopped
    assert len(sweep.points[0][1].samples_s) == 3


def test_a_dtype_without_a_kernel_is_left_out_not_guessed():
    def failing_clock(fn, calls):
        raise RuntimeError("\"addmm\" not implemented for 'Half'\nmore detail")

    sweep = tiny_sweep(failing_clock, tokens_grid=(1, 2), repeats=2, budget_s=10.0, dtype="float16")
    assert sweep.points == ()
    assert (
        sweep.stopped == "float16 matmul does not run on cpu: \"addmm\" not implemented for 'Half'"
    )


def test_other_processes_share_excludes_our_own_cpu_time():
    start = CpuTimes(busy=1000, total=5000, own=100)
    # 200 ticks on two CPUs: all busy, 100 of them ours -> others took half the machine
    assert others_cpu_share(start, CpuTimes(busy=1200, total=5200, own=200)) == 0.5
    assert others_cpu_share(start, CpuTimes(busy=1100, total=5200, own=200)) == 0.0
    assert others_cpu_share(start, start) == 0.0
    # too short an interval to tell: not measured
    assert measured_others_share(start, CpuTimes(busy=1100, total=5100, own=150)) is None
    assert measured_others_share(start, CpuTimes(busy=1200, total=5200, own=200)) == 0.5
    assert measured_others_share(None, start) is None


@pytest.fixture(scope="module")
def tiny_profile() -> HardwareProfile:
    warnings: list[str] = []
    profile = measure_profile(
        plan=TINY_PLAN,
        device="cpu",
        arch=TINY_ARCH,
        name="tiny",
        command="hrm profile (test)",
        quiet=True,
        warn=warnings.append,
    )
    assert warnings == list(profile.provenance.get("warnings", []))
    return profile


def test_a_tiny_run_gives_plausible_numbers(tiny_profile):
    cpu = tiny_profile.cpu
    assert tiny_profile.source == "measured" and tiny_profile.gpu is None
    assert 1e9 <= cpu.memory_bandwidth_bytes_per_s <= 1e13
    assert "float32" in cpu.peak_flops_per_s
    for dtype, rate in cpu.peak_flops_per_s.items():
        assert 1e9 <= rate <= 1e16, dtype
        assert cpu.matmul_curves[dtype].best == rate  # peak = best achieved point
    assert [x for x, _ in cpu.matmul_curves["float32"].points] == [1.0, 8.0, 64.0]
    assert 0 < cpu.available_memory_bytes <= cpu.memory_bytes
    assert cpu.cores >= 1


def test_a_tiny_run_records_its_provenance(tiny_profile):
    provenance = tiny_profile.provenance
    keys = ("date", "host", "cpu_model", "cores", "torch", "command", "load_average_1min")
    for key in (*keys, "other_processes_cpu_share"):
        assert key in provenance, key
    bandwidth = provenance["cpu_memory_bandwidth"]
    assert bandwidth["stored_as_memory_bandwidth"] == "read"
    assert set(bandwidth) >= {"read", "copy", "triad"}
    assert set(bandwidth["read"]) == {"median", "slowest", "fastest"}
    # the copy it stores is bytes copied: half of STREAM's count, which reads and writes each
    copied = tiny_profile.cpu.copy_bandwidth_bytes_per_s
    assert units.format_bandwidth(2 * copied) == bandwidth["copy"]["median"]
    assert "512" in provenance["cpu_matmul"]["shape"]


def test_the_written_profile_validates_and_round_trips(tiny_profile, tmp_path):
    path = tiny_profile.save(tmp_path / "tiny.yaml")
    loaded = HardwareProfile.load(path)
    assert loaded.to_dict() == tiny_profile.to_dict()
    assert loaded.cpu.memory_bandwidth_bytes_per_s == tiny_profile.cpu.memory_bandwidth_bytes_per_s


def test_a_tiny_run_times_the_executors_widened_path_for_16_bit(tiny_profile):
    cpu = tiny_profile.cpu
    for key in ("bfloat16_widened", "float16_widened"):
        assert [x for x, _ in cpu.matmul_curves[key].points] == [1.0, 8.0, 64.0]
    assert set(tiny_profile.provenance["cpu_matmul"]["spread"]) >= {"bfloat16_widened"}


def test_a_tiny_run_times_every_other_gemm_shape_on_each_path(tiny_profile):
    """q, k/v, o, router, w2 and the LM head each get curves of their own (w1's is the main
    sweep's, at matmul_shape), and so do the generic shapes other models are read between, for
    float32 and both bf16 paths, at the plan's shape grid."""
    curves = tiny_profile.cpu.gemm_shape_curves
    w1 = gemm_shape_key(TINY_ARCH.hidden_size, TINY_ARCH.intermediate_size)
    assert tiny_profile.cpu.matmul_shape == w1
    timed = {gemm_shape_key(*s) for s in (*gemm_shapes(TINY_ARCH), *GENERIC_SHAPES)}
    assert set(curves) == timed - {w1}
    for key, by_rate in curves.items():
        packed = {"bfloat16_packed"} if packing_missing("bfloat16") is None else set()
        assert set(by_rate) == {"float32", "bfloat16", "bfloat16_widened"} | packed, key
        assert [x for x, _ in by_rate["float32"].points][0] == 1.0
    notes = tiny_profile.provenance["cpu_gemm_shapes"]
    assert notes["tokens"] == [1, 8]
    assert all(": " in line for line in notes["points_not_measured"])


@pytest.mark.parametrize(
    "path",
    [
        "native",
        "widened",
        pytest.param(
            "packed",
            marks=pytest.mark.skipif(
                packing_missing("bfloat16") is not None, reason="no oneDNN bf16 kernels here"
            ),
        ),
    ],
)
def test_each_path_rotates_weight_copies_and_computes_the_executors_gemm(monkeypatch, path):
    import torch

    import hrm.profiling.matmul as matmul
    from hrm.rules.gemm_paths import WIDEN_SLICE_ELEMENTS, pack_weight

    weights_seen = []
    for name in ("native_linear", "widened_linear", "packed_linear"):
        inner = getattr(matmul, name)

        def recorder(x, w, *args, _inner=inner, _name=name, **kwargs):
            weights_seen.append((_name, id(w)))
            return _inner(x, w, *args, **kwargs)

        monkeypatch.setattr(matmul, name, recorder)

    def clock(fn, n):
        for _ in range(n):
            fn()
        return 1e-3 * n

    shape = GemmShape(model="t", hidden=64, intermediate=128)
    sweep = sweep_matmul(
        dtype="bfloat16",
        shape=shape,
        tokens_grid=(1, 4),
        device="cpu",
        clock=clock,
        repeats=4,
        min_sample_s=0.0,
        budget_s=10.0,
        tick=lambda: None,
        path=path,
        streamed_bytes=3 * 64 * 128 * 2,  # three copies of the bf16 weight
    )
    label = {"native": "bfloat16"}.get(path, f"bfloat16_{path}")
    assert sweep.dtype == label and [t for t, _ in sweep.points] == [1, 4]
    # every call is the executor's function for that path, each on the next of three copies
    assert {name for name, _ in weights_seen} == {f"{path}_linear"}
    assert len({ptr for _, ptr in weights_seen}) == 3
    assert weights_seen[0][1] != weights_seen[1][1]
    # rotation computes the real product, weight after weight
    weights = [torch.randn(128, 64).to(torch.bfloat16) for _ in range(2)]
    x = torch.randn(3, 64).to(torch.bfloat16)
    scratch = torch.empty(WIDEN_SLICE_ELEMENTS) if path == "widened" else None
    turn = [0]
    run = [pack_weight(w) for w in weights] if path == "packed" else weights
    first, second = (matmul._rotating_gemm(x, run, path, scratch, turn) for _ in range(2))
    for w, out in ((weights[0], first), (weights[1], second)):
        expected = (x.float() @ w.float().t()).to(torch.bfloat16)
        assert torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_the_profile_records_the_cpus_matrix_features_and_cache(tiny_profile):
    from hrm.profiling.cpu import MATRIX_FEATURES, host_facts, matrix_features

    features = tiny_profile.provenance["cpu_matrix_features"]
    assert features == list(matrix_features())
    assert set(features) <= set(MATRIX_FEATURES)
    cache = tiny_profile.provenance["cpu_last_level_cache_bytes"]
    assert cache == (int(host_facts().last_level_cache_bytes or 0) or "unknown")


def test_clock_and_power_reads_nvidia_smi_or_says_none():
    """Parsed from nvidia-smi's CSV where it answers; None where it is absent or fails."""
    import subprocess

    from hrm.profiling.gpu import CLOCK_POWER_FIELDS, clock_and_power

    line = "1980, 1980, 2619, 412.35, 700.00, 54, 0x0000000000000000\n"

    def answers(command, **kwargs):
        assert command[0] == "nvidia-smi" and "--format=csv,noheader,nounits" in command
        return subprocess.CompletedProcess(command, 0, stdout=line, stderr="")

    state = clock_and_power(answers)
    assert list(state) == list(CLOCK_POWER_FIELDS)
    assert state["clocks.sm"] == "1980" and state["power.draw"] == "412.35"

    def absent(command, **kwargs):
        raise FileNotFoundError(command[0])

    def fails(command, **kwargs):
        return subprocess.CompletedProcess(command, 9, stdout="", stderr="no devices")

    assert clock_and_power(absent) is None and clock_and_power(fails) is None


def test_gpu_gemm_points_span_the_sustain_time():
    """The full profile times each GPU GEMM point for at least 1 s in all, the quick one 0.3 s."""
    from hrm.profiling import PRESETS

    for name, least in (("full", 1.0), ("quick", 0.3)):
        plan = PRESETS[name]
        assert plan.gpu_gemm_sample_s * plan.repeats >= least - 1e-9


def test_presets_time_every_small_row_count_decode_gives_one_expert():
    """fp32 sgemm is not smooth at 1-4 rows (two and three GEMVs, then a GEMM kernel), so no
    curve may interpolate there: each preset times every row count of SMALL_ROWS, at the w1
    shape and at every other shape."""
    from hrm.profiling import PRESETS, SMALL_ROWS

    assert SMALL_ROWS == (1, 2, 3, 4, 8)
    for plan in PRESETS.values():
        assert set(SMALL_ROWS) <= set(plan.tokens_grid), plan.name
        assert set(SMALL_ROWS) <= set(plan.shape_tokens_grid), plan.name
        for grid in (plan.tokens_grid, plan.shape_tokens_grid):
            assert list(grid) == sorted(set(grid)), plan.name


def test_presets_leave_no_gap_wider_than_4x_from_16_rows_up():
    """A power law from 16 to 256 rows understated the GEMM rate at 32-128 rows by 9-25% on the
    EPYC VM (a decode batch of 64, a 128-token prompt's prefill); across 4x it was off by at most
    7%. Each preset's grids, at the w1 shape and at every other shape, step by at most 4x."""
    from hrm.profiling import PRESETS

    for plan in PRESETS.values():
        for grid in (plan.tokens_grid, plan.shape_tokens_grid):
            upper = [n for n in grid if n >= 16]
            assert all(b <= 4 * a for a, b in itertools.pairwise(upper)), (plan.name, grid)


def test_bandwidth_of_one_kind_times_that_kind_alone():
    """A caller that needs the read rate alone (bench/bench_cpu_attention.py) times only read;
    by default read, copy and triad each move their own bytes."""
    from hrm.profiling.cpu import BANDWIDTH_KINDS, measure_bandwidth

    small = dict(array_bytes=4e6, repeats=1, min_sample_s=0.0, tick=lambda: None)
    read = measure_bandwidth(**small, kinds=("read",))
    every = measure_bandwidth(**small)
    assert list(read) == ["read"] and list(every) == list(BANDWIDTH_KINDS)
    moved = {kind: nbytes for kind, (_, nbytes) in every.items()}
    assert moved["copy"] == 2 * moved["read"] and moved["triad"] == 3 * moved["read"]
    assert read["read"][1] == moved["read"]
