"""Keeping freed memory in a stub's heap: config parameter ``heap_keep_freed_bytes``.

glibc's malloc gives memory back to the kernel as soon as it is freed: every block over its mmap
threshold (at most 32 MB) is unmapped, and the top of the heap is trimmed past its trim threshold.
A model that allocates large arrays on every request (the Whisper models: 37 MB of cross K/V per
window, in ONNX Runtime's outputs, the stubs' copies and the decoder's cache) then gets fresh
pages every time, which the kernel must fault in and zero. On a VM whose freed memory goes back to
the host (this project's benchmark machine) that is ~1 s per 150 MB instead of ~15 ms, measured
(docs/speech.md). With the parameter, the stub keeps large blocks on its heap (no mmap) and keeps
up to that many freed bytes at the heap's top; the price is that much resident memory, per stub."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Mapping

HEAP_KEEP_PARAMETER = "heap_keep_freed_bytes"
# glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
MAX_KEEP_BYTES = 2**31 - 1


def keep_freed_heap(parameters: Mapping[str, str]) -> int | None:
    """Apply the model's ``heap_keep_freed_bytes`` to this process → the bytes kept, None when the
    parameter is absent or 0. ValueError for a value that is not an int of at most 2 GiB - 1,
    RuntimeError where the C library has no glibc ``mallopt``."""
    keep = int(parameters.get(HEAP_KEEP_PARAMETER) or 0)
    if keep <= 0:
        return None
    if keep > MAX_KEEP_BYTES:  # mallopt takes an int
        raise ValueError(f"{HEAP_KEEP_PARAMETER}: {keep} is over {MAX_KEEP_BYTES}")
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None or not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, ctypes.c_int(keep))):
        raise RuntimeError(f"{HEAP_KEEP_PARAMETER}: this C library's malloc cannot be set to keep freed memory")
    return keep
