"""`hrm profile --disk`: the storage's read curve, timed with O_DIRECT or refused, and its place
in a profile file."""

from __future__ import annotations

import pytest

from hrm.errors import HrmError
from hrm.hardware import HardwareProfile, resolve_hardware
from hrm.hardware.parts import Curve, DiskSpec
from hrm.profiling import disk
from tests.conftest import assert_one_line_error, refuse_o_direct


def test_read_curve_is_timed_at_each_size_and_the_probe_removed(tmp_path):
    spec = disk.measure_disk(tmp_path, file_bytes=2**20, budget_s=0.01)
    sizes = [x for x, _ in spec.read_curve.points]
    assert sizes == [4096.0, 65536.0, 1048576.0]  # no read larger than the probe file
    assert all(rate > 0 for _, rate in spec.read_curve.points)
    assert spec.read_bytes_per_s == spec.read_curve.best and spec.direct
    assert spec.path == str(tmp_path.resolve())
    assert list(tmp_path.iterdir()) == []


def test_o_direct_refused_is_said_unless_buffered_reads_are_asked(tmp_path, monkeypatch):
    refuse_o_direct(monkeypatch, disk)
    with pytest.raises(HrmError, match="refuses O_DIRECT.*--disk-buffered"):
        disk.measure_disk(tmp_path, file_bytes=2**16, budget_s=0.01)
    spec = disk.measure_disk(tmp_path, file_bytes=2**16, budget_s=0.01, direct=False)
    assert not spec.direct and len(spec.read_curve.points) == 2
    assert list(tmp_path.iterdir()) == []


def test_disk_round_trips_through_a_profile_file(tmp_path):
    curve = Curve(points=((4096.0, 3e7), (8388608.0, 4.1e9)))
    spec = DiskSpec(read_bytes_per_s=4.1e9, read_curve=curve, path="/data", direct=False)
    profile = HardwareProfile(**{**resolve_hardware("l4").__dict__, "disk": spec})
    again = HardwareProfile.load(profile.save(tmp_path / "p.yaml"))
    assert again.disk == spec
    assert spec.read_seconds(4.1e9, 8388608) == pytest.approx(1.0)
    assert spec.read_seconds(3e7, 4096) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "section, fragment",
    [({"read": "3 GB/s", "speed": 1}, "unknown key 'speed'"),
     ({"read_curve": [[4096, "1 GB/s"]]}, "missing key 'read'"),
     ({"read": "3 GB/s", "direct": "yes"}, "direct must be true or false")],
)  # fmt: skip
def test_malformed_disk_section_is_named(section, fragment):
    data = resolve_hardware("l4").to_dict() | {"disk": section}
    with pytest.raises(HrmError, match=fragment):
        HardwareProfile.from_dict(data, where="p.yaml")


def test_profile_refuses_a_missing_disk_before_measuring(run_cli, tmp_path):
    out = tmp_path / "p.yaml"
    status, _, err = run_cli("profile", "--disk", tmp_path / "absent", "-o", out)
    assert_one_line_error(status, err, "absent", "no such directory")
    status, _, err = run_cli("profile", "--disk-buffered", "-o", out)
    assert_one_line_error(status, err, "--disk-buffered needs --disk")
    assert not out.exists()
