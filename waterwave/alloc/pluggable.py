"""Registering Waterwave with PyTorch as its CUDA allocator: the entry
points ``waterwave._C`` exports (or the torch bridge in front of them, which
raises torch's own out-of-memory error) given to
``torch.cuda.memory.CUDAPluggableAllocator``, with ``Tensor.record_stream``
and ``torch.cuda.empty_cache()`` wired too; and the settings the CUDA
runtime creates each device's stack with. ``waterwave.cuda`` exposes these
under torch's names.

May import: waterwave._C and this package; torch lazily.
"""
from __future__ import annotations

import ctypes
import warnings
from typing import Any

from .. import _C
from .._C import AllocatorConfig
from . import torch_bridge
from .settings import resolve_settings

MALLOC = "waterwave_cuda_malloc"
FREE = "waterwave_cuda_free"
RECORD_STREAM = "waterwave_cuda_record_stream"
EMPTY_CACHE = "waterwave_cuda_empty_cache"

_installed: Any = None  # the torch allocator object, kept alive for the process


def configure(policy: str | None = None, config: str | AllocatorConfig | None = None,
              driver: str | None = None, **kwargs: Any) -> dict:
    """Set the policy and configuration the CUDA allocators are created with
    (they are created at each device's first allocation). Returns the
    settings. Refused once memory has been allocated."""
    policy, settings = resolve_settings(policy, config, **kwargs)
    _C.cuda_configure(policy, settings, driver or "")
    return current_settings()


def current_settings() -> dict:
    """The policy, the ``AllocatorConfig`` and the driver library the CUDA
    allocators are created with."""
    return _C.cuda_settings()


def _hook_address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def install_allocator(policy: str | None = None, config: str | None = None,
                      driver: str | None = None, **kwargs: Any) -> dict:
    """Make PyTorch allocate CUDA memory with Waterwave. Call it before
    anything touches CUDA (PyTorch refuses to swap an allocator in use);
    once per process. ``policy``: ``"waterwave"`` (default) or
    ``"pytorch"``; ``config``/keywords as for ``waterwave.Allocator``.
    Also wires ``Tensor.record_stream`` and ``torch.cuda.empty_cache()``.
    Out of memory raises ``torch.cuda.OutOfMemoryError`` through the torch
    bridge (torch_bridge.py: built against this torch at install time or
    now, once); without a C++ compiler it warns and raises ``RuntimeError``.
    Returns the settings, with ``oom_error`` naming the type raised."""
    global _installed
    import torch

    if _installed is not None:
        raise RuntimeError("the Waterwave allocator is already installed in this process")
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError(f"this torch ({torch.__version__}) is built without CUDA: install a "
                           "CUDA build of torch to use the Waterwave allocator")
    settings = configure(policy, config, driver, **kwargs)
    # The entry points live in waterwave._C itself, or in the bridge in
    # front of it: opening _C again gives the module already loaded, so
    # PyTorch and Python share one state.
    entry, settings["oom_error"] = (_C.__file__, MALLOC, FREE), "RuntimeError"
    if not torch_bridge.disabled():
        try:
            entry = (str(torch_bridge.load(_C.__file__, torch)), torch_bridge.MALLOC,
                     torch_bridge.FREE)
            settings["oom_error"] = "torch.cuda.OutOfMemoryError"
        except torch_bridge.BridgeUnavailable as e:
            warnings.warn(f"Waterwave: out of memory will raise RuntimeError, not "
                          f"torch.cuda.OutOfMemoryError: {e}. Set WATERWAVE_TORCH_BRIDGE=off to "
                          "accept that silently.", RuntimeWarning, stacklevel=2)
    plug = torch.cuda.memory.CUDAPluggableAllocator(*entry)
    lib = ctypes.CDLL(_C.__file__)
    plug.allocator().set_record_stream_fn(_hook_address(lib, RECORD_STREAM))
    plug.allocator().set_reset_fn(_hook_address(lib, EMPTY_CACHE))
    try:
        torch.cuda.memory.change_current_allocator(plug)
    except RuntimeError as e:
        raise RuntimeError(f"cannot install the Waterwave allocator: {e}. Call "
                           "waterwave.install_allocator() at process start, before any CUDA "
                           "tensor or torch.cuda call") from None
    _installed = plug
    return settings


def is_installed() -> bool:
    """Whether ``install_allocator()`` ran in this process."""
    return _installed is not None
