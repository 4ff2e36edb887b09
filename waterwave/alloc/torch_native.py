"""The native registration: Waterwave as PyTorch's own CUDA caching
allocator (torch_native.cpp, a full ``CUDAAllocator``), so that
``torch.cuda.memory_stats()``, ``max_memory_allocated()``,
``reset_peak_memory_stats()``, ``memory_summary()``,
``torch.cuda.memory._record_memory_history``/``_snapshot``, cuDNN's benchmark
mode and the rest work unchanged. Built against the torch in use by
``torch_bridge.NATIVE`` (it needs the CUDA runtime's headers); where it
cannot be built, ``install_allocator`` falls back to the pluggable
registration and says why.

May import: waterwave._C, this package.
"""
from __future__ import annotations

import ctypes

from .. import _C
from .torch_bridge import NATIVE, BridgeUnavailable, address, install_error

# _C's entry points, in the order torch_native.cpp's Core lists them.
ENTRY_POINTS = (
    "waterwave_cuda_try_malloc", "waterwave_cuda_free_owned", "waterwave_cuda_record_stream",
    "waterwave_cuda_empty_cache", "waterwave_cuda_device_stats", "waterwave_cuda_reset_stats",
    "waterwave_cuda_memory_fraction", "waterwave_cuda_mem_info",
    "waterwave_cuda_allocation_size", "waterwave_cuda_visit_segments",
    "waterwave_cuda_record_history", "waterwave_cuda_history_enabled",
    "waterwave_cuda_visit_history", "waterwave_cuda_pool_create", "waterwave_cuda_pool_begin",
    "waterwave_cuda_pool_end", "waterwave_cuda_pool_release", "waterwave_cuda_pool_use_count",
    "waterwave_cuda_pool_malloc", "waterwave_cuda_pools_empty", "waterwave_cuda_pool_restore",
)


def install(torch=None) -> str:
    """Build (once) and load the native registration, point it at _C, and
    make it PyTorch's CUDA allocator. Returns the library's path.
    ``BridgeUnavailable`` when it cannot be built or loaded (the caller falls
    back); ``RuntimeError`` when PyTorch's allocator is already in use."""
    native, path = NATIVE.open(torch)
    core = ctypes.CDLL(_C.__file__)
    entries = (ctypes.c_void_p * len(ENTRY_POINTS))(*(address(core, n) for n in ENTRY_POINTS))
    init = native.waterwave_native_init
    init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    init.restype = ctypes.c_int
    abi = init(entries, core.waterwave_native_abi(), core.waterwave_cuda_try_malloc_abi())
    if abi != 0:
        raise BridgeUnavailable(f"the native registration {path} speaks another ABI than "
                                f"waterwave._C (version {abi}): delete it to build it again")
    error = install_error(native.waterwave_native_install)
    if error is not None:
        raise RuntimeError(f"cannot install the Waterwave allocator: {error}. "
                           "Call waterwave.install_allocator() at process start, before any "
                           "CUDA tensor or torch.cuda call")
    return str(path)
