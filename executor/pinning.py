"""Host memory pinned at its exact size: page-aligned tensors registered with the CUDA runtime.

PyTorch's pinned caching allocator rounds each request up to a power of two, which would nearly
double the host memory of the weight arenas and the KV cache. Instead the memory is ordinary,
allocated page-aligned (cudaHostRegister pins whole pages), and registered (cudaHostRegister).
A refused registration leaves CUDA's sticky last error set, which would make the next CUDA call
fail for no reason of its own: it is read and cleared at once. Every registration is undone on
close, after the device has finished with the memory.
"""

from __future__ import annotations

import mmap

import torch

PAGE_BYTES = 4096


def page_aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed 1-D tensor of `numel` elements in memory of its own, mapped for it (so it starts
    on a page boundary) and unmapped when the tensor dies.

    Not from the heap: a run's weight arenas, page slots and KV cache are its largest buffers,
    and the heap keeps what it frees (hrm.rules.host_memory), so the buffers of one run left
    holes that the next run's, of other sizes, fitted only in part. At Mixtral 8x7B's shape (2
    layers) `hrm validate --quick` peaked at 21.5 GB where its largest run holds 12
    (docs/decisions.md, 2026-12-05)."""
    if not numel:  # (latent attention's V rows: nothing to map)
        return torch.zeros(0, dtype=dtype)
    buffer = mmap.mmap(-1, numel * dtype.itemsize)
    return torch.frombuffer(buffer, dtype=dtype, count=numel)


def _loaded_cudart_clear() -> None:
    """cudaGetLastError from the libcudart this process has loaded (torch binds no such call:
    torch.cuda.cudart() has cudaHostRegister but not cudaGetLastError)."""
    import ctypes

    with open("/proc/self/maps") as maps:
        path = next((line.split()[-1] for line in maps if "libcudart" in line), None)
    if path is not None:
        ctypes.CDLL(path).cudaGetLastError()


class HostPins:
    """The tensors this run registered with CUDA; `cudart` is torch.cuda.cudart() or a fake."""

    def __init__(self, cudart=None):
        self._cudart = cudart
        self.pinned: list[torch.Tensor] = []

    @property
    def cudart(self):
        if self._cudart is None:
            self._cudart = torch.cuda.cudart()
        return self._cudart

    def pin(self, tensor: torch.Tensor) -> bool:
        """Register the tensor's bytes; False (and CUDA's error cleared) when the host refuses."""
        nbytes = tensor.numel() * tensor.element_size()
        if int(self.cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)) != 0:
            clear = getattr(self.cudart, "cudaGetLastError", None) or _loaded_cudart_clear
            clear()  # otherwise the next kernel launch check would report this error
            return False
        self.pinned.append(tensor)
        return True

    def pin_all(self, tensors: list[torch.Tensor]) -> bool:
        """All of them, or none: on a refusal the ones pinned so far are unpinned."""
        for tensor in tensors:
            if not self.pin(tensor):
                self.close()
                return False
        return True

    def close(self) -> None:
        """Wait for the device's work on this memory, then unregister all of it."""
        if not self.pinned:
            return
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        for tensor in self.pinned:
            self.cudart.cudaHostUnregister(tensor.data_ptr())
        self.pinned.clear()


def release_host_tensor(t: torch.Tensor) -> None:
    """Give a host tensor's memory back once its bytes have been copied elsewhere: storage the
    tensor owns is freed (resized to nothing); a view of a file map (a checkpoint's) has its
    whole pages dropped, clean pages that a later touch would read again from the file."""
    storage = t.untyped_storage()
    if storage.resizable():
        storage.resize_(0)
        return
    import ctypes

    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first = -(-start // PAGE_BYTES) * PAGE_BYTES
    last = end // PAGE_BYTES * PAGE_BYTES
    if last > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4)
