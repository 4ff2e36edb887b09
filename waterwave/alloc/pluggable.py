"""Registering Waterwave with PyTorch as its CUDA allocator: natively, as
a full ``CUDAAllocator`` (torch_native.py), or through
``torch.cuda.memory.CUDAPluggableAllocator`` given the entry points
``waterwave._C`` exports (or the torch bridge in front of them, which raises
torch's own out-of-memory error), with ``Tensor.record_stream`` and
``torch.cuda.empty_cache()`` wired too; and the settings the CUDA runtime
creates each device's stack with. ``waterwave.cuda`` exposes these under
torch's names.

May import: waterwave._C and this package; torch lazily.
"""
from __future__ import annotations

import ctypes
import os
import warnings
from typing import Any

from .. import _C
from .._C import AllocatorConfig
from . import torch_bridge, torch_native
from .settings import resolve_settings

MALLOC = "waterwave_cuda_malloc"
FREE = "waterwave_cuda_free"
RECORD_STREAM = "waterwave_cuda_record_stream"
EMPTY_CACHE = "waterwave_cuda_empty_cache"
MEMORY_FRACTION = "waterwave_cuda_set_memory_fraction"

_installed: Any = None  # the pluggable allocator object or the native library's path, kept
_registration: str | None = None  # "native" or "pluggable", once installed


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


REGISTRATIONS = ("auto", "native", "pluggable")
REGISTRATION_ENV = "WATERWAVE_TORCH_REGISTRATION"


def install_allocator(policy: str | None = None, config: str | None = None,
                      driver: str | None = None, *, registration: str | None = None,
                      **kwargs: Any) -> dict:
    """Make PyTorch allocate CUDA memory with Waterwave. Call it before
    anything touches CUDA (PyTorch refuses to swap an allocator in use);
    once per process. ``policy``: ``"waterwave"`` (default) or
    ``"pytorch"``; ``config``/keywords as for ``waterwave.Allocator``.

    ``registration`` (default ``$WATERWAVE_TORCH_REGISTRATION``, else
    ``"auto"``): ``"native"`` makes Waterwave PyTorch's own CUDA caching
    allocator (torch_native.py: ``torch.cuda.memory_stats()``,
    ``max_memory_allocated()``, ``memory_summary()``, the memory history and
    snapshots, cuDNN's benchmark mode work unchanged), built against this
    torch at install time or now, once, and needing the CUDA runtime's
    headers; ``"pluggable"`` registers it through
    ``torch.cuda.memory.CUDAPluggableAllocator`` (those functions then raise
    in torch; ``waterwave.cuda`` has them); ``"auto"`` is native where it can
    be built, else pluggable with a warning saying why.

    Out of memory raises ``torch.cuda.OutOfMemoryError`` (natively, or
    through the torch bridge; without a C++ compiler the pluggable path warns
    and raises ``RuntimeError``). Returns the settings, with
    ``registration`` and ``oom_error`` naming what is in force."""
    global _installed, _registration
    import torch

    if _installed is not None:
        raise RuntimeError("the Waterwave allocator is already installed in this process")
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError(f"this torch ({torch.__version__}) is built without CUDA: install a "
                           "CUDA build of torch to use the Waterwave allocator")
    registration = registration or os.environ.get(REGISTRATION_ENV) or "auto"
    if registration not in REGISTRATIONS:
        raise ValueError(f"registration must be one of {', '.join(REGISTRATIONS)}; got "
                         f"{registration!r}")
    settings = configure(policy, config, driver, **kwargs)
    if registration != "pluggable":
        try:
            _installed = torch_native.install(torch)
            _registration = "native"
            return {**settings, "registration": "native",
                    "oom_error": "torch.cuda.OutOfMemoryError"}
        except torch_bridge.BridgeUnavailable as e:
            if registration == "native":
                raise RuntimeError(f"the native registration is not available: {e}") from None
            warnings.warn(f"Waterwave: registered through torch's pluggable allocator, so "
                          f"torch.cuda.memory_stats() and its kin raise (waterwave.cuda has "
                          f"them): the native registration could not be built: {e}. "
                          f"Set {REGISTRATION_ENV}=pluggable to accept that silently.",
                          RuntimeWarning, stacklevel=2)
    return _install_pluggable(torch, settings)


def _install_pluggable(torch, settings: dict) -> dict:
    global _installed, _registration
    # The entry points live in waterwave._C itself, or in the bridge in
    # front of it: opening _C again gives the module already loaded, so
    # PyTorch and Python share one state.
    entry, oom_error, bridge = (_C.__file__, MALLOC, FREE), "RuntimeError", None
    if not torch_bridge.disabled():
        try:
            bridge = torch_bridge.load(_C.__file__, torch)
            entry = (str(bridge), torch_bridge.MALLOC, torch_bridge.FREE)
            oom_error = "torch.cuda.OutOfMemoryError"
        except torch_bridge.BridgeUnavailable as e:
            warnings.warn(f"Waterwave: out of memory will raise RuntimeError, not "
                          f"torch.cuda.OutOfMemoryError: {e}. Set WATERWAVE_TORCH_BRIDGE=off to "
                          "accept that silently.", RuntimeWarning, stacklevel=3)
    plug = torch.cuda.memory.CUDAPluggableAllocator(*entry)
    lib = ctypes.CDLL(_C.__file__)
    plug.allocator().set_record_stream_fn(_hook_address(lib, RECORD_STREAM))
    plug.allocator().set_reset_fn(_hook_address(lib, EMPTY_CACHE))
    plug.allocator().set_memory_fraction_fn(_hook_address(lib, MEMORY_FRACTION))
    if bridge is not None:  # a graph capture is refused (no private pools), not left unsafe
        plug.allocator().set_begin_allocate_to_pool(
            _hook_address(ctypes.CDLL(str(bridge)), torch_bridge.BEGIN_ALLOCATE_TO_POOL))
    try:
        torch.cuda.memory.change_current_allocator(plug)
    except RuntimeError as e:
        raise RuntimeError(f"cannot install the Waterwave allocator: {e}. Call "
                           "waterwave.install_allocator() at process start, before any CUDA "
                           "tensor or torch.cuda call") from None
    _installed, _registration = plug, "pluggable"
    return {**settings, "registration": "pluggable", "oom_error": oom_error}


def registration() -> str | None:
    """How Waterwave is registered with PyTorch: ``"native"``,
    ``"pluggable"``, or None before ``install_allocator()``."""
    return _registration


def is_installed() -> bool:
    """Whether ``install_allocator()`` ran in this process."""
    return _installed is not None
