"""Giving the C heap's freed memory back during a GGUF build (after each large weight is
written out, and between a deploy's stages).

Each stage's segment is built (protobuf and numpy buffers of one tensor at a time) and then run
in an ONNX Runtime session; both free what they took, but glibc keeps freed blocks below its
mmap threshold in the process's heap, so without a trim the resident memory of a build grew
stage after stage by what the previous stages had freed (an 8-layer, 353 MB Llama-shaped file:
about 110 MB above the start after its first two stages, never given back).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """The C library's ``malloc_trim`` (glibc), or None where it has none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    result: Callable[[int], int] = trim
    return result


def release_freed_heap() -> None:
    """Hand memory the C heap holds but no longer uses back to the OS (``malloc_trim(0)``); a
    no-op off glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
