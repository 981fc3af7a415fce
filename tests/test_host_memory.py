"""Freed host memory is kept for reuse: a large block comes from malloc's heap, not a fresh mmap,
and stays there when freed (glibc's own counters, mallinfo2)."""

import ctypes
import platform

import pytest
import torch

from hrm.rules.host_memory import keep_freed_host_memory, release_freed_host_memory, released

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
        .split()
    ]  # fmt: skip


def _mallinfo() -> _MallInfo2:
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc before 2.33 has no mallinfo2")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2()


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_large_block_comes_from_the_heap_and_stays_there_when_freed():
    assert keep_freed_host_memory()
    size = 256 << 20  # far over glibc's mmap threshold (at most 32 MiB)
    before = _mallinfo()
    block = torch.ones(size // 4)
    during = _mallinfo()
    assert during.hblkhd - before.hblkhd < size // 2  # not a fresh mmap
    del block
    after = _mallinfo()
    assert after.fordblks - during.fordblks > 0.99 * size  # freed into the heap, not trimmed away


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_setting_it_again_succeeds_too():
    """Every executor model calls it; the settings are applied once (cached), and applying
    them again, uncached, is accepted by mallopt too."""
    assert keep_freed_host_memory() is True
    assert keep_freed_host_memory.__wrapped__() is True


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_released_memory_leaves_the_process_and_the_heap_is_still_kept():
    """A measurement's dropped weights stop counting against the host (a kept heap of packed
    copies grew a quick profile past 24 GB) and large blocks still come from the heap."""
    assert keep_freed_host_memory()
    size = 256 << 20
    spacer = torch.ones(1 << 20)  # the freed block sits below a live one: inside the heap
    block = torch.ones(size // 4)
    top = torch.ones(1 << 20)
    held = _resident_bytes()
    del block
    assert held - _resident_bytes() < size // 4  # kept: still resident
    release_freed_host_memory()
    assert held - _resident_bytes() > 0.9 * size  # handed back
    before = _mallinfo()
    again = torch.ones(size // 4)
    assert _mallinfo().hblkhd - before.hblkhd < size // 2  # not a fresh mmap
    del spacer, top, again


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_released_measurement_hands_back_what_it_freed():
    assert keep_freed_host_memory()
    floor = torch.ones(1 << 20)  # a live block below, so the freed one sits inside the heap

    def measure() -> int:
        block = torch.ones(64 << 20)  # 256 MiB, dropped on return
        top = torch.ones(1 << 20)
        return block.numel() + top.numel()

    before = _resident_bytes()
    assert released(measure)() == (64 << 20) + (1 << 20)
    assert _resident_bytes() - before < 64 << 20  # not the 256 MiB the call freed
    del floor
