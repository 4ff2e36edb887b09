"""CuPy's GPU memory from the Waterwave allocator: ``waterwave.cupy.install()``.

CuPy then allocates from the same per-device allocator stacks as PyTorch
under ``waterwave.install_allocator()`` (csrc/runtime): memory one library
frees, the other reuses, and ``waterwave.cuda.memory_stats()`` counts both.

Each allocation is made on CuPy's current stream (``with stream:``, per
thread), so the allocator orders reuse across streams for CuPy as it does
for PyTorch, and a free goes back on the stream the block was allocated on.
CuPy offers two hooks: ``CFunctionAllocator`` calls C without Python but is
never told the stream, and ``PythonFunctionAllocator`` calls Python that can
read it. Only the second can be stream-ordered, so CuPy pays one Python call
per allocation; PyTorch's path stays free of Python.

Out of memory raises ``cupy.cuda.memory.OutOfMemoryError``, what CuPy code
catches, carrying Waterwave's message and statistics.

May import: waterwave._C, waterwave.cuda; cupy lazily.
"""
from __future__ import annotations

from typing import Any

from . import _C, cuda
from ._C import OutOfMemoryError

_installed: Any = None  # the CuPy allocator object, kept alive for the process


def _cupy():
    try:
        import cupy
    except ImportError:
        raise ImportError("CuPy is not installed: pip install 'waterwave[cupy]' (CUDA 13) or "
                          "'waterwave[cupy12]' (CUDA 12)") from None
    return cupy


def current_stream() -> int:
    """CuPy's current stream on this thread, as a raw cudaStream_t."""
    return _cupy().cuda.get_current_stream().ptr


def _out_of_memory_type(cupy_oom: type) -> type:
    class WaterwaveOutOfMemoryError(cupy_oom):
        """cupy.cuda.memory.OutOfMemoryError with Waterwave's message."""

        def __init__(self, message: str, size: int, allocated: int):
            super().__init__(size, allocated)
            self.message = message

        def __str__(self) -> str:
            return self.message

    return WaterwaveOutOfMemoryError


def make_allocator(cupy=None):
    """The ``PythonFunctionAllocator`` ``install`` sets."""
    cupy = cupy or _cupy()
    return cupy.cuda.memory.PythonFunctionAllocator(*functions(cupy))


def functions(cupy=None):
    """(malloc(size, device) -> pointer, free(pointer, device)): malloc on
    CuPy's current stream; free never raises (CuPy frees from destructors;
    problems are counted in ``waterwave.cuda.free_errors()``)."""
    cupy = cupy or _cupy()
    out_of_memory = _out_of_memory_type(cupy.cuda.memory.OutOfMemoryError)
    malloc_on = _C.cuda_malloc
    free_on = _C.cuda_free

    def malloc(size: int, device: int) -> int:
        try:
            return malloc_on(size, device, current_stream())
        except OutOfMemoryError as e:
            raise out_of_memory(f"CUDA out of memory (Waterwave allocator, CuPy): {e}", size,
                                cuda.memory_allocated(device)) from None

    def free(ptr: int, device: int) -> None:
        free_on(ptr, 0, device, 0)  # the allocator knows the block's stream

    return malloc, free


def install(policy: str | None = None, config: str | None = None, driver: str | None = None,
            **kwargs: Any) -> dict:
    """Route CuPy's allocations to Waterwave, in this process and every
    thread. Settings as for ``install_allocator``; with none given, the
    settings ``install_allocator`` already made are kept. Returns them."""
    global _installed
    cupy = _cupy()
    if _installed is not None:
        raise RuntimeError("waterwave.cupy.install() already ran in this process")
    if policy or config or driver or kwargs or not cuda.is_installed():
        settings = cuda.configure(policy, config, driver, **kwargs)
    else:
        settings = _C.cuda_settings()
    allocator = make_allocator(cupy)
    cupy.cuda.set_allocator(allocator.malloc)
    _installed = allocator
    return settings


def is_installed() -> bool:
    """Whether ``install()`` ran in this process."""
    return _installed is not None
