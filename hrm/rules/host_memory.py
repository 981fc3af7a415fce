"""Host memory the process frees is kept for its next allocation, as the CUDA caching allocator
keeps device memory.

glibc's malloc serves every block over 32 MiB with a fresh mmap and hands it back on free, so
each large temporary (an expert's [rows, width] activations, a GEMM's output, prefill's attention
scores) is faulted in page by page, zeroed by the kernel, every time it is made. On the 2-core
SPR VM a 2-layer float32 prefill of 8192 tokens took 500-600 thousand minor faults and 3.4-3.6 s,
with more system time than user time; with freed memory kept, under 10 thousand faults and
2.9-3.2 s (docs/decisions.md, 2026-12-02). The profile and the executor both run with it, so
what `hrm profile` times is what a run pays. Frameworks reach the same end by preloading
jemalloc or tcmalloc (Intel Extension for PyTorch's tuning guide, "Memory Allocator"); mallopt
needs no new library.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# mallopt parameters, glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


@functools.cache
def keep_freed_host_memory() -> bool:
    """Serve large blocks from the heap (no mmap) and never trim it back to the OS, so freed
    memory is reused without page faults. Idempotent; a no-op (False) off glibc. The cost: the
    process's resident memory stays at its peak, as on a GPU."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 on success; -1 for M_TRIM_THRESHOLD means never trim (mallopt(3))
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))


def release_freed_host_memory() -> None:
    """Hand the pages of freed blocks back to the OS (malloc_trim: the heap's top, and
    madvise of free pages inside it), keeping the heap's layout. For measurements that make and
    drop large weights one after another: a kept heap holds every hole they leave, and a quick
    profile at Mixtral 8x7B's shape grew past 24 GB on its packed sweeps' copies. A no-op off
    glibc."""
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def released(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn`, with the pages its call freed handed back after each call: measurements that build
    models and caches one after another pile their holes up in the kept heap (a full profile at
    Mixtral 8x7B's shape was killed for memory on a 24 GB host; each step alone peaked under
    4 GB)."""

    @functools.wraps(fn)
    def call(*args, **kwargs) -> T:
        out = fn(*args, **kwargs)
        release_freed_host_memory()
        return out

    return call
