"""hrm.rules.cpu_gemm: one choice of CPU GEMM path per dtype and token count, priced as it runs.

Synthetic curves stand for the two kinds of host: an AVX2 CPU (widened float32 faster at every
token count, sgemm's dip at 12 rows), an AMX CPU (native bf16 faster everywhere), and one where
the winner changes with the token count.
"""

from __future__ import annotations

import dataclasses

import pytest

from hrm.errors import HrmError
from hrm.hardware import resolve_hardware
from hrm.hardware.parts import Curve
from hrm.rules.cpu_gemm import (
    CpuGemmChoice,
    MeasuredRates,
    choose_cpu_gemm,
    gemm_flops_per_s,
    gemm_peak_flops_per_s,
    has_choice_curves,
    pays_to_pad,
    shape_curve,
)
from tests.gemm_curves import AMX, AMX_PACKED, AVX2, AVX512_PACKED, MIXED, rates, scaled


def test_avx2_widens_at_every_token_count_and_pads_where_sgemm_dips():
    choice = choose_cpu_gemm(rates(AVX2), "bfloat16")
    assert choice.paths == ("widened",)
    assert all(choice.path_at(t) == "widened" for t in range(1, 3000, 7))
    assert choice.padded == ("widened",)  # 16 rows in 16/60 of the time 12 take: 12/25
    assert choice.rows_at(12) == 16 and choice.rows_at(8) == 8 and choice.rows_at(17) == 32


def test_amx_runs_native_everywhere_and_does_not_pad_where_it_would_not_pay():
    choice = choose_cpu_gemm(rates(AMX), "bfloat16")
    assert choice.paths == ("native",)
    # native: 12 rows at 130, 16 at 168 GFLOP/s: 16 rows take 0.095, 12 take 0.092 (no gain)
    assert choice.padded == ()
    assert choice.rows_at(12) == 12


def test_packed_is_taken_at_every_token_count_where_it_saves_time_over_the_grid():
    """Packed is all or nothing: on AMX it runs every count, 256 rows too, where it is 3% slower
    than native (a packed weight serves no other path)."""
    choice = choose_cpu_gemm(rates(AMX_PACKED), "bfloat16")
    assert choice.paths == ("packed",) and choice.buckets == ((0.0, "packed"),)
    assert all(choice.path_at(t) == "packed" for t in (1, 12, 256, 5000))
    r = rates(AMX_PACKED)
    assert gemm_flops_per_s(r, choice, 16) == 250e9  # priced on the packed curve
    assert gemm_flops_per_s(r, choice, 256) == 540e9
    assert gemm_peak_flops_per_s(r, choice) == 640e9


def test_packed_is_not_taken_where_it_loses_or_saves_no_more_than_noise():
    # AVX-512 without bf16 units: oneDNN emulates bf16, widened float32 is faster
    assert choose_cpu_gemm(rates(AVX512_PACKED), "bfloat16").paths == ("widened",)
    near = {**AMX, "bfloat16_packed": scaled(AMX["bfloat16"], 1.05)}
    assert choose_cpu_gemm(rates(near), "bfloat16").paths == ("native",)
    # packed may be forced, and is priced on native's curve where the rates have none of its own
    forced = choose_cpu_gemm(rates(AMX), "bfloat16", "packed")
    assert forced.paths == ("packed",) and forced.source == "--cpu-gemm packed"
    assert gemm_flops_per_s(rates(AMX), forced, 16) == 168e9


def test_the_winner_changes_with_the_token_count():
    choice = choose_cpu_gemm(rates(MIXED), "bfloat16")
    assert choice.paths == ("native", "widened")
    assert [choice.path_at(t) for t in (1, 4, 12, 16)] == ["native"] * 4
    assert [choice.path_at(t) for t in (64, 256, 1024, 5000)] == ["widened"] * 4
    # the switch sits half way, in log tokens, between the grid points 16 and 64
    assert choice.buckets == ((0.0, "native"), (32.0, "widened"))
    assert choice.path_at(31.9) == "native" and choice.path_at(32) == "widened"


def test_the_planner_prices_the_chosen_path_not_the_faster_of_two():
    r = rates(MIXED)
    choice = choose_cpu_gemm(r, "bfloat16")
    assert gemm_flops_per_s(r, choice, 16) == 200e9  # native's curve
    assert gemm_flops_per_s(r, choice, 256) == 300e9  # widened's curve
    forced = choose_cpu_gemm(r, "bfloat16", "widened")
    assert gemm_flops_per_s(r, forced, 16) == 66e9  # slower, but what the executor would run
    assert gemm_peak_flops_per_s(r, choice) == 320e9
    assert gemm_peak_flops_per_s(r, choose_cpu_gemm(r, "bfloat16", "native")) == 200e9


def test_a_padded_gemm_is_priced_at_the_rows_it_runs():
    r = rates(AVX2)
    choice = choose_cpu_gemm(r, "bfloat16")
    # 12 useful rows run as 16, at the 16-row rate: useful FLOP/s = 60 * 12 / 16
    assert gemm_flops_per_s(r, choice, 12) == pytest.approx(60e9 * 12 / 16)
    assert gemm_flops_per_s(r, choice, 4) == 17e9


def test_padding_is_measured_not_assumed():
    assert pays_to_pad(scaled(AVX2["bfloat16_widened"], 1e9))
    assert not pays_to_pad(scaled(AMX["bfloat16"], 1e9))
    assert not pays_to_pad(None)
    without_12 = Curve(points=((1.0, 1e9), (16.0, 8e9)))
    assert not pays_to_pad(without_12)


def test_float32_runs_natively_and_a_forced_path_is_stated():
    r = MeasuredRates(matmul_curves={"float32": scaled(AVX2["bfloat16_widened"], 1e9)})
    choice = choose_cpu_gemm(r, "float32")
    assert choice.paths == ("native",) and choice.padded == ("native",)
    forced = choose_cpu_gemm(r, "float32", "widened")
    assert forced.paths == ("native",) and "16-bit" in forced.source
    native = choose_cpu_gemm(rates(AVX2), "bfloat16", "native")
    assert native.paths == ("native",) and native.source == "--cpu-gemm native"
    with pytest.raises(HrmError, match="--cpu-gemm: unknown path 'fast'"):
        choose_cpu_gemm(r, "bfloat16", "fast")


def test_peaks_alone_choose_one_path_with_float32_standing_in_for_widened():
    l4 = resolve_hardware("l4").cpu  # datasheet: no curves, no widened rate
    assert not has_choice_curves(l4, "bfloat16")
    slow_native = dataclasses.replace(l4, peak_flops_per_s={"float32": 1e12, "bfloat16": 1e11})
    assert choose_cpu_gemm(slow_native, "bfloat16").paths == ("widened",)
    fast_native = dataclasses.replace(l4, peak_flops_per_s={"float32": 1e12, "bfloat16": 4e12})
    assert choose_cpu_gemm(fast_native, "bfloat16").paths == ("native",)


def test_old_profiles_lack_the_curves_the_choice_needs():
    """ci-cpu was profiled before the 12-token point: padding cannot be read from it."""
    cpu = resolve_hardware("ci-cpu").cpu
    assert not has_choice_curves(cpu, "bfloat16")
    assert has_choice_curves(rates(AVX2), "bfloat16")
    assert not has_choice_curves(rates({"bfloat16": AVX2["bfloat16"]}), "bfloat16")
    # a host that packs needs the packed curve too: a profile taken before it is stale there
    assert not has_choice_curves(rates(AMX), "bfloat16", ("native", "widened", "packed"))
    assert has_choice_curves(rates(AMX_PACKED), "bfloat16", ("native", "widened", "packed"))


def test_a_choice_round_trips_through_its_record_form():
    packed = choose_cpu_gemm(rates(AMX_PACKED), "bfloat16", source="probe")
    assert CpuGemmChoice.from_dict(packed.to_dict()) == packed
    choice = choose_cpu_gemm(rates(MIXED), "bfloat16", source="profile x")
    record = {**choice.to_dict(), "calls": {"native": 3}}
    assert CpuGemmChoice.from_dict(record) == choice
    with pytest.raises(HrmError, match="unknown key 'speed'"):
        CpuGemmChoice.from_dict({**record, "speed": 1})
    with pytest.raises(HrmError, match="buckets"):
        CpuGemmChoice.from_dict({**record, "buckets": [[0, "turbo"]]})


def test_a_path_within_timing_noise_of_native_is_not_taken():
    native = AMX["bfloat16"]
    near = {"bfloat16": native, "bfloat16_widened": scaled(native, 1.05)}  # 5% faster: noise
    assert choose_cpu_gemm(rates(near), "bfloat16").paths == ("native",)
    clear = {"bfloat16": native, "bfloat16_widened": scaled(native, 1.2)}
    assert choose_cpu_gemm(rates(clear), "bfloat16").paths == ("widened",)


# fp32 sgemm at 1024x3584 on the AVX-512 EPYC VM, ms per call: 2 and 3 rows run as GEMVs
EPYC_FP32_MS = {1: 0.95, 2: 1.91, 3: 2.69, 4: 1.93, 8: 1.79, 16: 2.19}


def timed(ms: dict[int, float]) -> Curve:
    """A curve whose time per call at x rows is ms[x] (rate = rows / time, in rows per ms)."""
    return Curve(points=tuple((float(x), x / t) for x, t in sorted(ms.items())))


def test_a_small_row_count_pads_to_a_measured_one_that_runs_clearly_faster():
    """3 rows (2.69 ms) -> 4 (1.93) and 8 (1.79) both save over 10%; 8 is fastest, and 4 is
    within 10% of it (1.93 <= 1.969), so the smaller, 4. 2 rows (1.91): 8 saves 6%, noise. 4
    rows: 8 saves 7%. Unmeasured counts (5-7) never pad."""
    from hrm.rules.cpu_gemm import small_row_pads

    assert small_row_pads(timed(EPYC_FP32_MS)) == {3: 4}
    assert small_row_pads(scaled(AMX["bfloat16"], 1e9)) == {}  # rate grows faster than rows
    assert small_row_pads(None) == {}


def test_each_shape_pads_by_its_own_curve_and_the_planner_prices_the_rows_run():
    w1 = timed(EPYC_FP32_MS)
    # the LM head: 3 rows (28.6 ms) -> 4 (23.0), not 8 (25.0: within 10% of 4, larger)
    head = timed({1: 8.1, 2: 18.8, 3: 28.6, 4: 23.0, 8: 25.0})
    flat = timed({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 8: 1.0})  # memory-bound: never pads
    r = MeasuredRates(
        matmul_curves={"float32": w1},
        gemm_shape_curves={"1024x32000": {"float32": head}, "1024x256": {"float32": flat}},
    )
    choice = choose_cpu_gemm(r, "float32")
    assert choice.small_pads == {"native": {"*": {3: 4}, "1024x32000": {3: 4}, "1024x256": {}}}
    assert choice.rows_at(3) == 4 and choice.rows_at(2) == 2 and choice.rows_at(2.5) == 4
    assert choice.rows_at(3, (1024, 32000)) == 4 and choice.rows_at(3, (1024, 256)) == 3
    assert choice.rows_at(3, (3584, 1024)) == 4  # no curve of its own: the w1 curve's pad
    # 3 useful rows run as 4, at the 4-row rate
    assert gemm_flops_per_s(r, choice, 3) == pytest.approx(w1.at(4) * 3 / 4)
    assert gemm_flops_per_s(r, choice, 3, (1024, 256)) == pytest.approx(flat.at(3))
    assert "rows 3->4" in choice.describe()


def test_a_choice_with_small_pads_round_trips_and_old_records_read_without_them():
    r = MeasuredRates(matmul_curves={"float32": timed(EPYC_FP32_MS)})
    choice = choose_cpu_gemm(r, "float32", source="profile x")
    record = choice.to_dict()
    assert record["small_pads"] == {"native": {"*": {"3": 4}}}
    assert CpuGemmChoice.from_dict(record) == choice
    old = {k: v for k, v in record.items() if k != "small_pads"}
    assert CpuGemmChoice.from_dict(old).rows_at(3) == 3
    with pytest.raises(HrmError, match="small_pads must map"):
        CpuGemmChoice.from_dict({**record, "small_pads": {"native": {"*": {"three": 4}}}})


def _flat(gflops: float) -> Curve:
    return Curve(points=((1.0, gflops * 1e9), (256.0, gflops * 1e9)))


def test_a_shape_not_measured_is_read_between_the_measured_sizes_nearest_it():
    """log rate linear in log(d_in * d_out) between the nearest measured sizes, flat beyond;
    shapes of one size averaged (w1 and w2); a router (narrow) read from narrow ones only."""
    r = MeasuredRates(
        matmul_curves={"float32": _flat(100)},
        matmul_shape="4096x14336",
        gemm_shape_curves={
            "1024x512": {"float32": _flat(10)},
            "4096x1024": {"float32": _flat(80)},
            "14336x4096": {"float32": _flat(400)},
            "4096x8": {"float32": _flat(1)},
        },
    )
    # 2048 x 1024 holds 4x the weights of 1024 x 512 and half those of 4096 x 1024: 2/3 of the way
    assert shape_curve(r, "float32", (2048, 1024)).at(16) == pytest.approx(
        10e9 ** (1 / 3) * 80e9 ** (2 / 3)
    )
    assert shape_curve(r, "float32", (512, 256)).at(16) == pytest.approx(10e9)  # below: flat
    assert shape_curve(r, "float32", (8192, 32000)).at(16) == pytest.approx(200e9)  # w1 and w2
    assert shape_curve(r, "float32", (1024, 64)).at(16) == pytest.approx(1e9)  # narrow: the router
    assert shape_curve(r, "float32", (4096, 1024)).points[0][1] == 80e9  # measured
    assert shape_curve(r, "float32", (4096, 14336)) is r.matmul_curves["float32"]  # w1
    assert shape_curve(r, "float32", None) is r.matmul_curves["float32"]
    # a rate key no shape measured keeps the w1 curve
    assert shape_curve(r, "bfloat16", (2048, 1024)) is None


def test_the_choice_follows_the_runs_expert_shape_not_the_profiles():
    """Packed ran 1.1x native at Mixtral 8x7B's expert and 1.3-1.8x at hidden 1024's: a profile
    of the one chooses packed for the other where its smaller shapes say so."""
    big = {"bfloat16": _flat(500), "bfloat16_widened": _flat(200), "bfloat16_packed": _flat(520)}
    small = {"bfloat16": _flat(300), "bfloat16_widened": _flat(150), "bfloat16_packed": _flat(480)}
    r = MeasuredRates(
        matmul_curves=big, matmul_shape="4096x14336", gemm_shape_curves={"1024x512": small}
    )
    assert choose_cpu_gemm(r, "bfloat16").paths == ("native",)
    assert choose_cpu_gemm(r, "bfloat16", shape=(4096, 14336)).paths == ("native",)
    chosen = choose_cpu_gemm(r, "bfloat16", shape=(1024, 384))
    assert chosen.paths == ("packed",)
    assert gemm_flops_per_s(r, chosen, 16, (1024, 384)) == pytest.approx(480e9)


def test_a_shape_is_read_from_its_own_input_width_where_one_was_timed():
    r = MeasuredRates(
        matmul_curves={"float32": _flat(100)},
        gemm_shape_curves={
            "1024x512": {"float32": _flat(10)},
            "1024x4096": {"float32": _flat(40)},
            "4096x1024": {"float32": _flat(80)},
        },
    )
    # 1024 x 2048 lies 2/3 of the way (in log size) between the two of d_in 1024; 4096 x
    # 1024's, of a like size, does not enter
    expected = 10e9 ** (1 / 3) * 40e9 ** (2 / 3)
    assert shape_curve(r, "float32", (1024, 2048)).at(16) == pytest.approx(expected)
    # no measured shape of d_in 2048: read by size among all, 4096 x 1024 and 1024 x 4096 averaged
    assert shape_curve(r, "float32", (2048, 2048)).at(16) == pytest.approx((40e9 * 80e9) ** 0.5)
