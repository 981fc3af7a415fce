import copy

import pytest
import yaml

from hrm import units
from hrm.errors import HrmError
from hrm.hardware import HardwareProfile, bundled_profile_names, resolve_hardware
from hrm.hardware.parts import Curve
from hrm.hardware.stand_in import stand_in_profile

EXPECTED_BUNDLED = {"t4", "l4", "2xt4", "4xt4", "a100-80g", "h100-sxm", "h200-sxm"}


def test_every_required_profile_is_bundled():
    assert EXPECTED_BUNDLED <= set(bundled_profile_names())


@pytest.mark.parametrize("name", sorted(EXPECTED_BUNDLED))
def test_bundled_profiles_load_and_round_trip(name, tmp_path):
    profile = resolve_hardware(name)
    assert profile.source == "datasheet"
    assert profile.gpu is not None and profile.link is not None
    path = profile.save(tmp_path / f"{name}.yaml")
    assert HardwareProfile.load(path) == profile


def test_datasheet_figures_are_dense_and_per_gpu():
    l4 = resolve_hardware("l4")
    assert l4.gpu.flops_per_s("bfloat16") == 121e12  # dense, not the 242 sparse figure
    assert l4.gpu.memory_bytes == 24e9
    t4x4 = resolve_hardware("4xt4")
    assert t4x4.gpu.count == 4
    assert t4x4.gpu.total_memory_bytes == 64e9
    assert t4x4.gpu.flops_per_s("float16") == 4 * 65e12
    assert t4x4.h2d_bytes_per_s == 4 * t4x4.link.h2d_bytes_per_s


def test_half_dtype_is_float16_on_t4_and_bfloat16_on_l4():
    assert resolve_hardware("t4").half_dtype == "float16"
    assert resolve_hardware("4xt4").half_dtype == "float16"
    assert resolve_hardware("l4").half_dtype == "bfloat16"


def _l4_dict():
    return resolve_hardware("l4").to_dict()


def test_cpu_only_profile_is_valid():
    data = _l4_dict()
    del data["gpu"], data["link"]
    profile = HardwareProfile.from_dict(data)
    assert not profile.has_gpu and profile.gpu_count == 0 and profile.h2d_bytes_per_s == 0


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda d: d.pop("cpu"), "missing key 'cpu'"),
        (lambda d: d["gpu"].pop("memory"), "gpu: missing key 'memory'"),
        (lambda d: d["gpu"].update(memroy="24 GB"), "unknown key 'memroy'"),
        (lambda d: d["gpu"].update(memory="-24 GB"), "gpu: memory"),
        (lambda d: d["gpu"].update(count=0), "gpu: count"),
        (lambda d: d["cpu"]["flops"].update(float32="fast"), "cpu: flops: float32"),
        (lambda d: d["cpu"]["flops"].update(float64="1 TFLOP/s"), "unknown key 'float64'"),
        (lambda d: d.pop("link"), "needs a 'link'"),
        (lambda d: d["link"].update(h2d="16 GB"), "link: h2d"),
        (lambda d: d.update(source="guessed"), "source must be one of"),
        (
            lambda d: d["cpu"].update(
                matmul_curves={"float32": [[2, "1 TFLOP/s"], [1, "1 TFLOP/s"]]}
            ),
            "matmul_curves: float32",
        ),
    ],
)
def test_invalid_profiles_name_the_problem(mutate, fragment):
    data = copy.deepcopy(_l4_dict())
    mutate(data)
    with pytest.raises(HrmError) as exc:
        HardwareProfile.from_dict(data)
    assert fragment in str(exc.value)


def test_resolve_by_path_and_unknown_name(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(_l4_dict()))
    assert resolve_hardware(str(path)).name == "l4"
    with pytest.raises(HrmError, match="unknown hardware profile 'l5'"):
        resolve_hardware("l5")
    with pytest.raises(HrmError, match="no such file"):
        resolve_hardware(str(tmp_path / "absent.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpu: [unclosed\n")
    with pytest.raises(HrmError, match="malformed YAML"):
        resolve_hardware(str(bad))


def test_curve_is_a_power_law_between_points_and_flat_outside():
    curve = Curve(points=((1.0, 10.0), (100.0, 30.0)))
    assert curve.at(0.5) == 10.0
    assert curve.at(1000.0) == 30.0
    assert curve.at(1.0) == 10.0
    # halfway in log size: the geometric mean of the rates, sqrt(10 * 30)
    assert curve.at(10.0) == pytest.approx(300**0.5)
    # a memory-bound stretch, rate proportional to rows: exact between its points
    bound = Curve(points=((1.0, 20e9), (4.0, 80e9)))
    assert bound.at(2.25) == pytest.approx(45e9)
    assert curve.best == 30.0


def test_measured_curves_replace_peaks():
    data = _l4_dict()
    data["cpu"]["matmul_curves"] = {"bfloat16": [[1, "0.1 TFLOP/s"], [1024, "1 TFLOP/s"]]}
    profile = HardwareProfile.from_dict(data)
    assert profile.cpu.matmul_flops_per_s("bfloat16", 1) == pytest.approx(0.1e12)
    assert profile.cpu.matmul_flops_per_s("float32", 1) == profile.cpu.flops_per_s("float32")
    assert HardwareProfile.from_dict(profile.to_dict()) == profile


def test_with_resources_changes_one_thing():
    l4 = resolve_hardware("l4")
    more = l4.with_resources(cpu_memory_bytes=400e9, link_bytes_per_s=32e9)
    assert more.cpu.memory_bytes == 400e9 and more.link.h2d_bytes_per_s == 32e9
    assert more.gpu == l4.gpu
    cpu_only = HardwareProfile.from_dict(
        {k: v for k, v in _l4_dict().items() if k not in ("gpu", "link")}
    )
    with pytest.raises(HrmError, match="has no GPU"):
        cpu_only.with_resources(gpu_memory_bytes=1e9)


def test_widened_rates_belong_to_the_cpu_only():
    data = resolve_hardware("l4").to_dict()
    data["cpu"]["flops"]["bfloat16_widened"] = "0.9 TFLOP/s"
    profile = HardwareProfile.from_dict(copy.deepcopy(data))
    assert profile.cpu.flops_per_s("bfloat16_widened") == 0.9e12
    data["gpu"]["flops"]["bfloat16_widened"] = "1 TFLOP/s"
    with pytest.raises(HrmError, match="gpu: flops.*bfloat16_widened"):
        HardwareProfile.from_dict(data)


def test_interconnect_shared_links_and_price_round_trip_and_are_checked(tmp_path):
    data = resolve_hardware("4xt4").to_dict()
    data["interconnect"] = {"kind": "nvlink", "bandwidth": "300 GB/s"}
    data["link"]["shared"] = True
    data["price_per_hour"] = 1.4
    profile = HardwareProfile.from_dict(copy.deepcopy(data))
    assert profile.peer_bytes_per_s == 300e9 and profile.link.shared
    assert profile.h2d_bytes_per_s == profile.link.h2d_bytes_per_s  # one root complex for all
    assert profile.price_per_hour == 1.4
    assert HardwareProfile.load(profile.save(tmp_path / "p.yaml")) == profile
    # without an interconnect the GPUs talk PCIe peer to peer at the link's rate
    assert resolve_hardware("4xt4").peer_bytes_per_s == 12e9
    for key, value, fragment in (
        ("interconnect", {"kind": "infiniband", "bandwidth": "1 GB/s"}, "kind must be one of"),
        ("interconnect", {"kind": "nvlink"}, "missing key 'bandwidth'"),
        ("price_per_hour", -2, "price_per_hour must be a positive number"),
        ("price_per_hour", "cheap", "price_per_hour must be a positive number"),
    ):
        with pytest.raises(HrmError, match=fragment):
            HardwareProfile.from_dict({**copy.deepcopy(data), key: value})
    with pytest.raises(HrmError, match="shared must be true or false"):
        HardwareProfile.from_dict({**data, "link": {**data["link"], "shared": "yes"}})
    cpu_only = {k: v for k, v in data.items() if k not in ("gpu", "link")}
    with pytest.raises(HrmError, match="nvlink 'interconnect' section but no 'gpu'"):
        HardwareProfile.from_dict(cpu_only)


def test_a_measured_latency_round_trips_and_gloo_is_a_cpu_only_hosts(tmp_path):
    gpus = resolve_hardware("4xt4").to_dict()
    gpus["interconnect"] = {"kind": "pcie", "bandwidth": "12 GB/s", "latency": 5e-6}
    profile = HardwareProfile.from_dict(copy.deepcopy(gpus))
    assert profile.peer_step_latency_s == 5e-6
    assert HardwareProfile.load(profile.save(tmp_path / "p.yaml")) == profile
    # no interconnect: PCIe peer to peer with NCCL's step latency
    assert resolve_hardware("4xt4").peer_step_latency_s == pytest.approx(2.8e-6)
    host = resolve_hardware("ci-cpu").to_dict()
    host["interconnect"] = {"kind": "gloo", "bandwidth": "1 GB/s", "latency": 1.3e-4}
    cpu_only = HardwareProfile.from_dict(copy.deepcopy(host))
    assert HardwareProfile.load(cpu_only.save(tmp_path / "c.yaml")) == cpu_only
    stand_in = stand_in_profile(cpu_only, 4e9).with_gpu_count(2)
    assert (stand_in.peer_step_latency_s, stand_in.peer_bytes_per_s) == (1.3e-4, 1e9)
    assert HardwareProfile.load(stand_in.save(tmp_path / "s.yaml")) == stand_in
    # a stand-in without a measured one prices all-reduces by bytes alone, as before
    assert stand_in_profile(resolve_hardware("ci-cpu"), 4e9).peer_step_latency_s == 0.0
    for where, value, fragment in (
        (host, {"kind": "gloo", "bandwidth": "1 GB/s"}, "gloo interconnect needs its measured"),
        (host, {"kind": "gloo", "bandwidth": "1 GB/s", "latency": -1}, "latency must be a non"),
        (host, {"kind": "gloo", "bandwidth": "1 GB/s", "latency": "fast"}, "latency must be a"),
        (gpus, {"kind": "gloo", "bandwidth": "1 GB/s", "latency": 1e-4}, "CPU-only host's"),
    ):
        with pytest.raises(HrmError, match=fragment):
            HardwareProfile.from_dict({**copy.deepcopy(where), "interconnect": value})


def test_launch_overhead_is_measured_per_dtype_on_either_device_and_round_trips(tmp_path):
    data = resolve_hardware("l4").to_dict()
    fp32 = {"per_layer_s": 4e-4, "per_expert_s": 1.5e-4, "per_step_s": 3e-4}
    bf16 = {"per_layer_s": 6e-4, "per_expert_s": 0.5e-4, "per_step_s": 7e-4}
    data["cpu"]["launch_overhead"] = {"float32": fp32, "bfloat16": bf16}
    profile = HardwareProfile.from_dict(copy.deepcopy(data))
    assert profile.cpu.launch_overhead_for("bfloat16").per_expert_s == 0.5e-4
    assert profile.cpu.launch_overhead_for("float32").per_expert_s == 1.5e-4
    assert profile.cpu.launch_overhead_for("float16").per_expert_s == 1.5e-4  # float32's
    data["cpu"]["launch_overhead"] = {"bfloat16": bf16}  # a quick profile's
    quick = HardwareProfile.from_dict(copy.deepcopy(data)).cpu
    assert quick.launch_overhead_for("float32") == quick.launch_overhead_for("bfloat16")
    data["cpu"]["launch_overhead"] = {"float32": fp32, "bfloat16": bf16}
    assert HardwareProfile.load(profile.save(tmp_path / "p.yaml")) == profile
    assert profile.gpu.launch_overhead_for("bfloat16") is None  # not measured
    bad = copy.deepcopy(data)
    bad["cpu"]["launch_overhead"]["bfloat16"]["per_step_s"] = -1
    with pytest.raises(HrmError, match="bfloat16: per_step_s must be a non-negative number"):
        HardwareProfile.from_dict(bad)
    bad["cpu"]["launch_overhead"] = {"fp32": fp32}
    with pytest.raises(HrmError, match="launch_overhead: unknown key 'fp32'"):
        HardwareProfile.from_dict(bad)
    data["gpu"]["launch_overhead"] = data["cpu"]["launch_overhead"]
    on_both = HardwareProfile.from_dict(data)
    assert on_both.gpu.launch_overhead == on_both.cpu.launch_overhead


def test_launch_overhead_keeps_the_spread_of_each_figure_over_its_rounds(tmp_path):
    """How sure each fixed cost is, in the profile beside it; a profile without it still loads."""
    data = resolve_hardware("l4").to_dict()
    spread = {"per_layer_s": 2e-5, "per_expert_s": 4e-6, "per_step_s": 1e-5}
    data["cpu"]["launch_overhead"] = {
        "bfloat16": {
            "per_layer_s": 6e-4,
            "per_expert_s": 1e-4,
            "per_step_s": 7e-4,
            "spread": spread,
        }
    }
    profile = HardwareProfile.from_dict(copy.deepcopy(data))
    assert profile.cpu.launch_overhead["bfloat16"].spread == spread
    again = HardwareProfile.load(profile.save(tmp_path / "p.yaml"))
    assert again == profile
    assert "spread" not in again.to_dict()["gpu"].get("launch_overhead", {})
    data["cpu"]["launch_overhead"]["bfloat16"]["spread"] = {"per_token_s": 1e-6}
    with pytest.raises(HrmError, match="bfloat16: spread: unknown key 'per_token_s'"):
        HardwareProfile.from_dict(data)


def test_a_launch_overhead_from_before_dtypes_reads_as_float32s():
    """Profiles written before 2026-12-04 hold one entry, measured in float32."""
    data = resolve_hardware("l4").to_dict()
    data["cpu"]["launch_overhead"] = {"per_layer_s": 4e-4, "per_expert_s": 1e-4, "per_step_s": 0}
    cpu = HardwareProfile.from_dict(data).cpu
    assert set(cpu.launch_overhead) == {"float32"}
    assert cpu.launch_overhead_for("bfloat16").per_layer_s == 4e-4


def test_expert_ffn_curves_are_the_gpus_checked_and_round_trip(tmp_path):
    data = resolve_hardware("l4").to_dict()
    data["gpu"]["expert_ffn_curves"] = {"bfloat16": [[1, 2e12], [64, 9e13]]}
    profile = HardwareProfile.from_dict(copy.deepcopy(data))
    assert profile.gpu.expert_ffn_curves["bfloat16"].at(64) == 9e13
    assert HardwareProfile.load(profile.save(tmp_path / "p.yaml")) == profile
    for bad, message in (
        ({"bfloat16": [[64, 9e13], [1, 2e12]]}, "expert_ffn_curves: bfloat16"),
        ({"bfloat16": [[1, 0], [64, 9e13]]}, "expert_ffn_curves: bfloat16"),
        ({"int3": [[1, 2e12]]}, "int3"),
    ):
        with pytest.raises(HrmError, match=message):
            HardwareProfile.from_dict({**data, "gpu": {**data["gpu"], "expert_ffn_curves": bad}})
    data["cpu"]["expert_ffn_curves"] = data["gpu"].pop("expert_ffn_curves")
    with pytest.raises(HrmError, match="expert_ffn_curves is measured for the gpu only"):
        HardwareProfile.from_dict(data)


def test_gemm_shape_curves_are_the_cpus_checked_and_round_trip(tmp_path):
    data = resolve_hardware("l4").to_dict()
    curves = {"4096x1024": {"float32": [[1, 2e9], [64, 9e10]], "bfloat16_widened": [[1, 3e9]]}}
    data["cpu"]["gemm_shape_curves"] = curves
    data["cpu"]["matmul_shape"] = "4096x14336"  # where matmul_curves were timed
    profile = HardwareProfile.from_dict(copy.deepcopy(data))
    assert profile.cpu.gemm_shape_curves["4096x1024"]["float32"].at(64) == 9e10
    assert profile.cpu.matmul_shape == "4096x14336"
    assert HardwareProfile.load(profile.save(tmp_path / "p.yaml")) == profile
    with pytest.raises(HrmError, match="matmul_shape: '4096' is not a shape"):
        HardwareProfile.from_dict({**data, "cpu": {**data["cpu"], "matmul_shape": "4096"}})
    for bad, message in (
        ({"4096x1024": {"float32": [[64, 9e10], [1, 2e9]]}}, "4096x1024: float32"),
        ({"4096x1024": {"int3": [[1, 2e9]]}}, "int3"),
        ({"4096 by 1024": {"float32": [[1, 2e9]]}}, "is not a shape"),
        ({"0x1024": {"float32": [[1, 2e9]]}}, "is not a shape"),
        ([[1, 2e9]], "mapping of shapes"),
    ):
        with pytest.raises(HrmError, match=message):
            HardwareProfile.from_dict({**data, "cpu": {**data["cpu"], "gemm_shape_curves": bad}})
    data["gpu"]["gemm_shape_curves"] = data["cpu"].pop("gemm_shape_curves")
    with pytest.raises(HrmError, match="gemm_shape_curves is measured for the cpu only"):
        HardwareProfile.from_dict(data)


def test_pinnable_host_memory_round_trips_and_is_checked(tmp_path):
    data = resolve_hardware("l4").to_dict()
    data["link"]["pinnable"] = "64 GB"
    profile = HardwareProfile.from_dict(copy.deepcopy(data))
    assert profile.link.pinnable_bytes == 64e9
    assert HardwareProfile.load(profile.save(tmp_path / "p.yaml")) == profile
    with pytest.raises(HrmError, match="pinnable"):
        HardwareProfile.from_dict({**data, "link": {**data["link"], "pinnable": "lots"}})


def test_bundled_gpus_state_sustained_rates_that_the_planner_charges(tmp_path):
    """Every bundled GPU carries published sustained GEMM rates below its peak: the planner's
    GEMMs run at those, the roofline's top roof stays the peak; the figures round-trip."""
    for name, dtype in (
        ("t4", "float16"),
        ("l4", "bfloat16"),
        ("2xt4", "float16"),
        ("a100-80g", "bfloat16"),
        ("h100-sxm", "bfloat16"),
        ("h200-sxm", "bfloat16"),
    ):
        gpu = resolve_hardware(name).gpu
        sustained = gpu.sustained_flops_per_s[dtype]
        assert sustained < gpu.peak_flops_per_s[dtype]
        assert gpu.matmul_flops_per_s(dtype, 4096) == sustained * gpu.count
        assert gpu.flops_per_s(dtype) == gpu.peak_flops_per_s[dtype] * gpu.count
    profile = resolve_hardware("l4")
    assert HardwareProfile.load(profile.save(tmp_path / "l4.yaml")) == profile
    data = profile.to_dict()
    data["gpu"]["sustained_flops"] = {"float128": "1 TFLOP/s"}
    with pytest.raises(HrmError, match="float128"):
        HardwareProfile.from_dict(data)


def test_attention_curves_are_the_cpus_per_dtype_and_round_trip(tmp_path):
    """Decode (K/V bytes -> bytes/s) and prefill (FLOPs -> FLOP/s) attention curves per dtype."""
    data = resolve_hardware("l4").to_dict()
    data["cpu"]["attention_curves"] = {
        "bfloat16": [[1e6, "20 GB/s"], [1e8, "15 GB/s"]],
        "float32": [[1e6, "30 GB/s"]],
    }
    data["cpu"]["prefill_attention_curves"] = {"float32": [[1e6, "1 TFLOP/s"], [1e9, "2 TFLOP/s"]]}
    data["cpu"]["latent_attention_curves"] = {"bfloat16": [[1e6, "5 GB/s"], [1e8, "8 GB/s"]]}
    profile = HardwareProfile.from_dict(copy.deepcopy(data))
    assert profile.cpu.latent_attention_curves["bfloat16"].at(1e8) == 8e9
    assert profile.cpu.prefill_attention_curves["float32"].at(1e9) == 2e12
    assert profile.cpu.attention_curves["bfloat16"].at(1e6) == 20e9
    assert profile.cpu.attention_curves["float32"].at(1e8) == 30e9
    assert HardwareProfile.load(profile.save(tmp_path / "p.yaml")) == profile
    # a profile from before 2026-12-03 has one curve, measured in bfloat16
    old = copy.deepcopy(data)
    old["cpu"]["attention_curve"] = old["cpu"].pop("attention_curves")["bfloat16"]
    assert HardwareProfile.from_dict(old).cpu.attention_curves == {
        "bfloat16": profile.cpu.attention_curves["bfloat16"]
    }
    both = copy.deepcopy(data)
    both["cpu"]["attention_curve"] = [[1e6, "20 GB/s"]]
    with pytest.raises(HrmError, match="give attention_curves only"):
        HardwareProfile.from_dict(both)
    bad_dtype = copy.deepcopy(data)
    bad_dtype["cpu"]["attention_curves"]["float128"] = [[1e6, "1 GB/s"]]
    with pytest.raises(HrmError, match="float128"):
        HardwareProfile.from_dict(bad_dtype)
    unsorted = copy.deepcopy(data)
    unsorted["cpu"]["prefill_attention_curves"]["float32"].reverse()
    with pytest.raises(HrmError, match="prefill_attention_curves: float32"):
        HardwareProfile.from_dict(unsorted)
    on_gpu = copy.deepcopy(data)
    on_gpu["gpu"]["prefill_attention_curves"] = {"bfloat16": [[1e6, "1 TFLOP/s"]]}
    with pytest.raises(HrmError, match="prefill_attention_curves is measured for the cpu only"):
        HardwareProfile.from_dict(on_gpu)
    latent_on_gpu = copy.deepcopy(data)
    latent_on_gpu["gpu"]["latent_attention_curves"] = {"bfloat16": [[1e6, "5 GB/s"]]}
    with pytest.raises(HrmError, match="latent_attention_curves is measured for the cpu only"):
        HardwareProfile.from_dict(latent_on_gpu)
    data["gpu"]["attention_curves"] = {"bfloat16": [[1e6, "20 GB/s"]]}
    with pytest.raises(HrmError, match="attention_curves is measured for the cpu only"):
        HardwareProfile.from_dict(data)


def test_elementwise_rate_is_the_cpus_positive_and_round_trips(tmp_path):
    data = resolve_hardware("l4").to_dict()
    # without a measurement: each element from memory once, bandwidth / element size
    cpu = HardwareProfile.from_dict(copy.deepcopy(data)).cpu
    assert cpu.elementwise_elements_per_s("bfloat16") == cpu.memory_bandwidth_bytes_per_s / 2
    data["cpu"]["elementwise_rate"] = {"bfloat16": 4e9, "float32": 3e9}
    profile = HardwareProfile.from_dict(copy.deepcopy(data))
    assert profile.cpu.elementwise_elements_per_s("bfloat16") == 4e9
    # a dtype not measured takes float32's (profiles older than per-dtype figures have only
    # that), else another's: a quick profile times bfloat16 alone
    assert profile.cpu.elementwise_elements_per_s("float16") == 3e9
    data["cpu"]["elementwise_rate"] = {"bfloat16": 4e9}
    quick = HardwareProfile.from_dict(copy.deepcopy(data)).cpu
    assert quick.elementwise_elements_per_s("float32") == 4e9
    assert quick.elementwise_elements_per_s("float16") == 4e9
    assert HardwareProfile.load(profile.save(tmp_path / "p.yaml")) == profile
    for bad, message in (
        ({"bfloat16": 0}, "must be a positive number"),
        ({"bfloat16": "fast"}, "must be a positive number"),
        ({"float128": 1e9}, "float128"),
    ):
        data["cpu"]["elementwise_rate"] = bad
        with pytest.raises(HrmError, match=message):
            HardwareProfile.from_dict(copy.deepcopy(data))
    data["cpu"].pop("elementwise_rate")
    data["gpu"]["elementwise_rate"] = {"bfloat16": 4e9}
    with pytest.raises(HrmError, match="elementwise_rate is measured for the cpu only"):
        HardwareProfile.from_dict(data)


def test_copy_bandwidth_is_the_cpus_positive_and_round_trips(tmp_path):
    data = resolve_hardware("l4").to_dict()
    assert HardwareProfile.from_dict(copy.deepcopy(data)).cpu.copy_bandwidth_bytes_per_s is None
    data["cpu"]["copy_bandwidth"] = "12.5 GB/s"
    profile = HardwareProfile.from_dict(copy.deepcopy(data))
    assert profile.cpu.copy_bandwidth_bytes_per_s == 12.5e9
    assert HardwareProfile.load(profile.save(tmp_path / "p.yaml")) == profile
    for bad in (0, -1, "fast"):
        data["cpu"]["copy_bandwidth"] = bad
        with pytest.raises(HrmError, match="copy_bandwidth"):
            HardwareProfile.from_dict(copy.deepcopy(data))
    data["cpu"].pop("copy_bandwidth")
    data["gpu"]["copy_bandwidth"] = "100 GB/s"
    with pytest.raises(HrmError, match="copy_bandwidth is measured for the cpu only"):
        HardwareProfile.from_dict(data)


def test_the_bundled_cpu_profiles_copy_at_half_their_recorded_stream_copy():
    """The field was added to each from its own measurement (provenance), not estimated."""
    for name in ("ci-cpu", "ci-cpu-amx", "ci-cpu-amx-l3-105mb", "ci-cpu-avx512"):
        profile = resolve_hardware(name)
        stream = profile.provenance["cpu_memory_bandwidth"]["copy"]["median"]
        assert profile.cpu.copy_bandwidth_bytes_per_s == units.parse_bandwidth(stream) / 2, name
