"""Waterwave's CPU allocator: c10's CPU allocator with the CPU's thread
accounts in front (torch_cpu.cpp next door, built against the torch in use
by ``torch_bridge.TorchLibrary``), so that ``waterwave.sharing`` counts and
gates what each member's thread allocates on the CPU, as Waterwave's CUDA
allocator does on a GPU. Installed once, when a CPU session first gates a
member; tensors made before keep their allocator. Untagged threads pay a
thread-local read per allocation and an atomic load per free.

May import: waterwave._C, this package.
"""
from __future__ import annotations

import ctypes
import threading

from .. import _C
from .torch_bridge import CPU, BridgeUnavailable, address, install_error

_ENTRY_POINTS = ("waterwave_cpu_accounts_abi", "waterwave_cpu_before_allocate",
                 "waterwave_cpu_allocated", "waterwave_cpu_freed")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None


def install(torch=None) -> None:
    """Build (once), load and install the CPU allocator; again is a no-op.
    ``BridgeUnavailable`` when it cannot be built, loaded or installed."""
    global _library
    with _lock:
        if _library is not None and _library.waterwave_cpu_allocator_installed():
            return
        library, path = CPU.open(torch)
        core = ctypes.CDLL(_C.__file__)
        init = library.waterwave_cpu_allocator_init
        init.argtypes = [ctypes.c_void_p] * 4
        init.restype = ctypes.c_int
        abi = init(*(address(core, name) for name in _ENTRY_POINTS))
        if abi != 0:
            raise BridgeUnavailable(f"waterwave's CPU allocator {path} speaks another ABI than "
                                    f"waterwave._C (version {abi}): delete it to build it again")
        error = install_error(library.waterwave_cpu_allocator_install)
        if error is not None:
            raise BridgeUnavailable(error)
        _library = library


def is_installed() -> bool:
    return _library is not None and bool(_library.waterwave_cpu_allocator_installed())
