"""Finds, builds and loads the libraries compiled against the user's torch:
the torch bridge (torch_bridge.cpp next door: the pluggable registration's
entry points, raising ``torch.cuda.OutOfMemoryError`` when Waterwave runs
out of memory) and the native registration (torch_native.cpp, a full
``CUDAAllocator``; ``torch_native.py`` loads it). Each is a
``TorchLibrary``.

They link torch's libc10 (the native one libc10_cuda too, and needs the
CUDA runtime's headers), so they are built against the torch in use, never
shipped prebuilt. Where a library comes from, first match:

1. ``WATERWAVE_TORCH_BRIDGE=off``: nowhere; out of memory is a
   ``RuntimeError`` carrying the same message, through the pluggable path.
2. Built at install time next to ``waterwave._C`` (setup.py calls
   ``build_into``) when torch was importable then.
3. The cache, ``$WATERWAVE_CACHE_DIR`` or ``~/.cache/waterwave``, built
   there on first use with ``$CXX`` (else ``c++``): a few seconds, once.

Each file name carries a key of the torch version, its C++ ABI, the
sources' hash and the CUDA headers used, so a torch upgrade or an edited
source builds a new one.

May import: the standard library only (setup.py loads this file by its path,
before waterwave._C exists); torch lazily.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "torch_bridge.cpp"
MALLOC = "waterwave_torch_malloc"
FREE = "waterwave_torch_free"
BEGIN_ALLOCATE_TO_POOL = "waterwave_torch_begin_allocate_to_pool"
PREFIX = "_torch_bridge."
INSTALLED_DIR = HERE.parent  # where setup.py puts them, beside _C


class BridgeUnavailable(RuntimeError):
    """A library could not be built or loaded; the message says why and
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


def cache_dir() -> Path:
    root = os.environ.get("WATERWAVE_CACHE_DIR") or Path.home() / ".cache" / "waterwave"
    return Path(root)


def cuda_include_dirs() -> list[Path] | None:
    """Where the CUDA runtime's headers are, whole (``cuda_runtime.h`` and
    the ``crt/`` headers it includes, which NVIDIA's runtime wheel lacks
    and its compiler wheel or a CUDA toolkit has): ``$CUDA_HOME``,
    ``$CUDA_PATH``, /usr/local/cuda, then NVIDIA's wheels beside torch.
    None if nowhere."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates = [[Path(r) / "include"] for r in roots if r]
    for site in map(Path, sys.path):
        nvidia = site / "nvidia"
        if nvidia.is_dir():
            includes = sorted(p for p in nvidia.glob("*/include") if p.is_dir())
            if includes:
                candidates.append(includes)
    for dirs in candidates:
        if (any((d / "cuda_runtime.h").is_file() for d in dirs)
                and any((d / "crt" / "host_config.h").is_file() for d in dirs)):
            return dirs
    return None


@dataclass(frozen=True)
class TorchLibrary:
    """One library built against the user's torch: its sources (the first
    is compiled), its file prefix, and what it needs beyond libc10."""
    sources: tuple[Path, ...]
    prefix: str
    std: str = "c++17"
    cuda: bool = False  # needs libc10_cuda and the CUDA runtime's headers
    libraries: tuple[str, ...] = field(default=("c10",))

    def includes(self) -> list[Path]:
        if not self.cuda:
            return []
        found = cuda_include_dirs()
        if found is None:
            raise BridgeUnavailable(
                "the CUDA runtime's headers (cuda_runtime.h with its crt/ folder) were not "
                "found: set CUDA_HOME to a CUDA toolkit, or pip install nvidia-cuda-nvcc")
        return found

    def key(self, torch=None) -> str:
        """What the library was built from: torch's version and C++ ABI, the
        sources and the CUDA headers."""
        torch = torch or _torch()
        h = hashlib.sha256()
        for source in self.sources:
            if not source.exists():
                raise BridgeUnavailable(f"the source {source} is missing: reinstall waterwave")
            h.update(source.read_bytes())
        h.update(f"{torch.__version__}|{int(torch._C._GLIBCXX_USE_CXX11_ABI)}".encode())
        h.update("|".join(map(str, self.includes())).encode())
        return h.hexdigest()[:16]

    def file_name(self, torch=None) -> str:
        return f"{self.prefix}{self.key(torch)}.so"

    def compile_command(self, out: Path, torch=None, cxx: str | None = None) -> list[str]:
        torch = torch or _torch()
        root = Path(torch.__file__).parent
        lib = root / "lib"
        command = [
            cxx or os.environ.get("CXX") or "c++",
            f"-std={self.std}", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-isystem", str(root / "include"),
        ]
        for include in self.includes():
            command += ["-isystem", str(include)]
        command += [str(self.sources[0]), "-o", str(out), f"-L{lib}"]
        command += [f"-l{name}" for name in self.libraries]
        # As for _C (setup.py): the shared libstdc++, never a static copy.
        return command + [f"-Wl,-rpath,{lib}", "-l:libstdc++.so.6"]

    def build(self, out: Path, torch=None, cxx: str | None = None) -> Path:
        """Compile to ``out``. The file appears whole or not at all, so
        processes building at once never load half of one."""
        self.includes()  # no headers: say so before any file is made
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
        except OSError as e:
            raise BridgeUnavailable(f"cannot write {out.name} into {out.parent} ({e.strerror}): "
                                    "set WATERWAVE_CACHE_DIR to a writable folder") from None
        os.close(fd)
        command = self.compile_command(Path(tmp), torch, cxx)
        try:
            r = subprocess.run(command, capture_output=True, text=True, check=False)
        except OSError as e:
            os.unlink(tmp)
            raise BridgeUnavailable(
                f"cannot run the C++ compiler {command[0]!r} ({e.strerror}): install g++ (or set "
                "CXX) so Waterwave can build its torch bridge") from None
        if r.returncode != 0:
            os.unlink(tmp)
            raise BridgeUnavailable(f"building {out.name} failed ({' '.join(command)}):\n"
                                    f"{r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
        return out

    def build_into(self, directory: Path, torch=None, cxx: str | None = None) -> Path:
        """Build next to waterwave._C (setup.py), removing libraries built
        for an older torch or source."""
        out = Path(directory) / self.file_name(torch)
        for old in Path(directory).glob(f"{self.prefix}*.so"):
            if old != out:
                old.unlink()
        return self.build(out, torch, cxx)

    def library(self, torch=None) -> Path:
        """The library for the torch in use: the one built at install time,
        else the cached one, else one built into the cache now."""
        name = self.file_name(torch)
        installed = INSTALLED_DIR / name
        if installed.exists():
            return installed
        cached = cache_dir() / name
        if cached.exists():
            return cached
        return self.build(cached, torch)

    def open(self, torch=None) -> tuple[ctypes.CDLL, Path]:
        """The library, loaded. A cached file that does not load (truncated,
        built by a broken compiler) is rebuilt once."""
        path = self.library(torch)
        try:
            return ctypes.CDLL(str(path)), path
        except OSError as e:
            if path.parent != cache_dir():
                raise BridgeUnavailable(f"{path} does not load ({e}): reinstall waterwave, or "
                                        "delete the file to build it again") from None
            path.unlink(missing_ok=True)
            path = self.build(path, torch)
            try:
                return ctypes.CDLL(str(path)), path
            except OSError as e:
                raise BridgeUnavailable(f"{path}, just built, does not load: {e}") from None


BRIDGE = TorchLibrary((SOURCE,), PREFIX)
# The native registration: a CUDAAllocator, with c10_cuda's headers (C++20
# since torch 2.10) and the ABI header it shares with _C.
NATIVE = TorchLibrary((HERE / "torch_native.cpp", HERE / "native_abi.h"), "_torch_native.",
                      std="c++20", cuda=True, libraries=("c10", "c10_cuda"))
# Waterwave's CPU allocator (torch_cpu.cpp; cpu_allocator.py loads it).
CPU = TorchLibrary((HERE / "torch_cpu.cpp",), "_torch_cpu.")


def address(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def install_error(install_fn) -> str | None:
    """Call a built library's install entry point, ``int (char* message,
    size_t length)``: None when it installed, else the message it wrote."""
    message = ctypes.create_string_buffer(1024)
    install_fn.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    install_fn.restype = ctypes.c_int
    return message.value.decode() if install_fn(message, len(message)) != 0 else None


# The torch bridge, as module functions (setup.py and the pluggable path).
def key(torch=None) -> str:
    return BRIDGE.key(torch)


def file_name(torch=None) -> str:
    return BRIDGE.file_name(torch)


def build_into(directory: Path, torch=None, cxx: str | None = None) -> Path:
    return BRIDGE.build_into(directory, torch, cxx)


def load(c_library: str, torch=None) -> Path:
    """Load the bridge and point it at waterwave._C's allocation entry
    points (``c_library`` is _C's file). Returns the library's path for
    ``CUDAPluggableAllocator``."""
    bridge, path = BRIDGE.open(torch)
    core = ctypes.CDLL(c_library)
    init = bridge.waterwave_torch_bridge_init
    init.argtypes = [ctypes.c_void_p] * 3
    init.restype = ctypes.c_int
    abi = init(address(core, "waterwave_cuda_try_malloc"), address(core, "waterwave_cuda_free"),
               address(core, "waterwave_cuda_try_malloc_abi"))
    if abi != 0:
        raise BridgeUnavailable(f"the torch bridge {path} speaks another ABI than waterwave._C "
                                f"(version {abi}): delete it to build it again")
    return path
