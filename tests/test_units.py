import pytest
from hypothesis import given
from hypothesis import strategies as st

from hrm import units
from hrm.errors import HrmError


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16 GB", 16e9),
        ("16GB", 16e9),
        ("16GiB", 16 * 2**30),
        ("1.5 TB", 1.5e12),
        ("512 MiB", 512 * 2**20),
        ("100 bytes", 100.0),
        ("4096", 4096.0),
        (24e9, 24e9),
        (7, 7.0),
    ],
)
def test_parse_bytes(text, expected):
    assert units.parse_bytes(text) == expected


def test_parse_bandwidth_and_flops():
    assert units.parse_bandwidth("300 GB/s") == 300e9
    assert units.parse_bandwidth("3.35 TB/s") == 3.35e12
    assert units.parse_bandwidth("16 GiB/s") == 16 * 2**30
    assert units.parse_flops("65 TFLOP/s") == 65e12
    assert units.parse_flops("1.3 TFLOPS") == 1.3e12
    assert units.parse_flops(2.5e9) == 2.5e9


@pytest.mark.parametrize(
    "parse, value",
    [
        (units.parse_bytes, "sixteen GB"),
        (units.parse_bytes, "-3 GB"),
        (units.parse_bytes, "12 parsecs"),
        (units.parse_bytes, "0 GB"),
        (units.parse_bytes, True),
        (units.parse_bytes, None),
        (units.parse_bytes, "nan GB"),
        (units.parse_bandwidth, "300 GB"),  # a size where a bandwidth belongs
        (units.parse_flops, "65 TB/s"),
        (units.parse_flops, "inf TFLOP/s"),
    ],
)
def test_garbage_names_field_and_value(parse, value):
    with pytest.raises(HrmError) as exc:
        parse(value, "gpu: memory")
    assert "gpu: memory" in str(exc.value)
    assert repr(value) in str(exc.value)


def test_format_for_people():
    assert units.format_bytes(16e9) == "16 GB"
    assert units.format_bandwidth(3.35e12) == "3.35 TB/s"
    assert units.format_flops(121e12) == "121 TFLOP/s"
    assert units.format_bytes(512) == "512 B"


@given(st.floats(min_value=1e-3, max_value=1e18, allow_nan=False, allow_infinity=False))
def test_exact_format_round_trips(value):
    assert units.parse_bytes(units.format_bytes(value, None)) == value
    assert units.parse_bandwidth(units.format_bandwidth(value, None)) == value
    assert units.parse_flops(units.format_flops(value, None)) == value
