"""Finds, builds and loads the torch bridge (torch_bridge.cpp next door): the
entry points PyTorch calls, raising ``torch.cuda.OutOfMemoryError`` when
Waterwave runs out of memory.

The bridge links torch's libc10, so it is built against the torch in use,
never shipped prebuilt. Where the library comes from, first match:

1. ``WATERWAVE_TORCH_BRIDGE=off``: nowhere; out of memory is a
   ``RuntimeError`` carrying the same message.
2. Built at install time next to ``waterwave._C`` (setup.py calls
   ``build_into``) when torch was importable then.
3. The cache, ``$WATERWAVE_CACHE_DIR`` or ``~/.cache/waterwave``, built
   there on first use with ``$CXX`` (else ``c++``): a few seconds, once.

Each file name carries a key of the torch version, its C++ ABI and the
source's hash, so a torch upgrade or an edited bridge builds a new one.

May import: the standard library only (setup.py loads this file by its path,
before waterwave._C exists); torch lazily.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("torch_bridge.cpp")
MALLOC = "waterwave_torch_malloc"
FREE = "waterwave_torch_free"
PREFIX = "_torch_bridge."
INSTALLED_DIR = Path(__file__).resolve().parent.parent  # where setup.py puts it, beside _C


class BridgeUnavailable(RuntimeError):
    """The bridge could not be built or loaded; the message says why and
    what to do."""


def _torch():
    try:
        import torch
    except ImportError as e:
        raise BridgeUnavailable("torch is not installed: the torch bridge is built against it") from e
    return torch


def disabled() -> bool:
    """``WATERWAVE_TORCH_BRIDGE=off``: PyTorch calls waterwave._C directly."""
    return os.environ.get("WATERWAVE_TORCH_BRIDGE", "").lower() in ("0", "off", "false", "no")


def key(torch=None) -> str:
    """What the library was built from: torch's version and C++ ABI and the
    bridge's source."""
    torch = torch or _torch()
    if not SOURCE.exists():
        raise BridgeUnavailable(f"the bridge's source {SOURCE} is missing: reinstall waterwave")
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    h.update(f"{torch.__version__}|{int(torch._C._GLIBCXX_USE_CXX11_ABI)}".encode())
    return h.hexdigest()[:16]


def file_name(torch=None) -> str:
    return f"{PREFIX}{key(torch)}.so"


def cache_dir() -> Path:
    root = os.environ.get("WATERWAVE_CACHE_DIR") or Path.home() / ".cache" / "waterwave"
    return Path(root)


def compile_command(out: Path, torch=None, cxx: str | None = None) -> list[str]:
    torch = torch or _torch()
    root = Path(torch.__file__).parent
    lib = root / "lib"
    return [
        cxx or os.environ.get("CXX") or "c++",
        "-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        "-isystem", str(root / "include"),
        str(SOURCE), "-o", str(out),
        f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}",
        # As for _C (setup.py): the shared libstdc++, never a static copy.
        "-l:libstdc++.so.6",
    ]


def build(out: Path, torch=None, cxx: str | None = None) -> Path:
    """Compile the bridge to ``out``. The file appears whole or not at all,
    so processes building at once never load half of one."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    except OSError as e:
        raise BridgeUnavailable(f"cannot write the torch bridge into {out.parent} ({e.strerror}): "
                                "set WATERWAVE_CACHE_DIR to a writable folder") from None
    os.close(fd)
    command = compile_command(Path(tmp), torch, cxx)
    try:
        r = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as e:
        os.unlink(tmp)
        raise BridgeUnavailable(
            f"cannot run the C++ compiler {command[0]!r} ({e.strerror}): install g++ (or set CXX) "
            "so Waterwave can build its torch bridge") from None
    if r.returncode != 0:
        os.unlink(tmp)
        raise BridgeUnavailable(f"building the torch bridge failed ({' '.join(command)}):\n"
                                f"{r.stderr.strip()[-2000:]}")
    os.replace(tmp, out)
    return out


def build_into(directory: Path, torch=None, cxx: str | None = None) -> Path:
    """Build next to waterwave._C (setup.py), removing bridges built for an
    older torch or source."""
    out = Path(directory) / file_name(torch)
    for old in Path(directory).glob(f"{PREFIX}*.so"):
        if old != out:
            old.unlink()
    return build(out, torch, cxx)


def library(torch=None) -> Path:
    """The bridge for the torch in use: the one built at install time, else
    the cached one, else one built into the cache now."""
    name = file_name(torch)
    installed = INSTALLED_DIR / name
    if installed.exists():
        return installed
    cached = cache_dir() / name
    if cached.exists():
        return cached
    return build(cached, torch)


def load(c_library: str, torch=None) -> Path:
    """Load the bridge and point it at waterwave._C's allocation entry
    points (``c_library`` is _C's file). Returns the library's path for
    ``CUDAPluggableAllocator``. A cached file that does not load (truncated,
    built by a broken compiler) is rebuilt once."""
    path = library(torch)
    try:
        bridge = ctypes.CDLL(str(path))
    except OSError as e:
        if path.parent != cache_dir():
            raise BridgeUnavailable(f"the torch bridge {path} does not load ({e}): reinstall "
                                    "waterwave, or delete the file to build it again") from None
        path.unlink(missing_ok=True)
        path = build(path, torch)
        try:
            bridge = ctypes.CDLL(str(path))
        except OSError as e:
            raise BridgeUnavailable(f"the torch bridge {path}, just built, does not load: {e}") from None
    core = ctypes.CDLL(c_library)
    address = lambda lib, name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value  # noqa: E731
    init = bridge.waterwave_torch_bridge_init
    init.argtypes = [ctypes.c_void_p] * 3
    init.restype = ctypes.c_int
    abi = init(address(core, "waterwave_cuda_try_malloc"), address(core, "waterwave_cuda_free"),
               address(core, "waterwave_cuda_try_malloc_abi"))
    if abi != 0:
        raise BridgeUnavailable(f"the torch bridge {path} speaks another ABI than waterwave._C "
                                f"(version {abi}): delete it to build it again")
    return path
