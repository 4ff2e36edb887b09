"""Builds waterwave._C: the C++17 allocator stack, the simulated GPU, the CUDA
runtime, the planner's offset search and the benchmarks.

Needs neither torch nor a CUDA toolkit: the core talks to a device interface;
the simulator is compiled here, and the CUDA backend only declares the few
driver types it uses and opens libcuda at run time.

Where torch is importable at build time, the libraries built against it are
built next to _C too: the torch bridge (waterwave/alloc/torch_bridge.cpp,
which raises torch.cuda.OutOfMemoryError) and, where the CUDA runtime's
headers are found, the native registration (torch_native.cpp); elsewhere
they are built at first use.
"""
import glob
import importlib.util
import os
import sys
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("WATERWAVE_BUILD_JOBS", default=0).install()

sources = sorted(
    glob.glob("csrc/core/*.cpp")
    + glob.glob("csrc/alloc/*.cpp")
    + glob.glob("csrc/device/sim/*.cpp")
    + glob.glob("csrc/device/cuda/*.cpp")
    + glob.glob("csrc/runtime/*.cpp")
    + glob.glob("csrc/bench/*.cpp")
    + glob.glob("csrc/planner/*.cpp")
    + glob.glob("csrc/bindings/*.cpp")
)


def load_torch_bridge_builder():
    # By its path: importing the package would need the _C being built.
    spec = importlib.util.spec_from_file_location("torch_bridge", "waterwave/alloc/torch_bridge.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class BuildWithTorchBridge(build_ext):
    def run(self):
        super().run()
        try:
            import torch
        except ImportError:
            print("waterwave: torch is not installed; the torch bridge will be built at first use")
            return
        bridge = load_torch_bridge_builder()
        target = Path(self.get_ext_fullpath("waterwave._C")).parent
        for what, library in (("the torch bridge", bridge.BRIDGE),
                              ("the native registration", bridge.NATIVE),
                              ("the CPU allocator", bridge.CPU)):
            try:
                print(f"waterwave: built {what} {library.build_into(target, torch)}")
            except bridge.BridgeUnavailable as e:  # not fatal: install_allocator says why
                print(f"waterwave: warning: {what} was not built: {e}")


extra = ["-O2", "-Wall", "-Wextra", "-fvisibility=hidden"]
if os.environ.get("WATERWAVE_DEBUG"):
    extra = ["-O0", "-g", "-Wall", "-Wextra"]

setup(
    ext_modules=[
        Pybind11Extension(
            "waterwave._C",
            sources,
            cxx_std=17,
            extra_compile_args=extra,
            libraries=["dl"],  # the CUDA driver is opened at run time
            # The shared libstdc++, by name: where a toolchain has only the
            # static archive at hand (the GPU machine's image), _C got its own
            # copy of the iostreams and crashed in std::codecvt next to torch's.
            extra_link_args=["-l:libstdc++.so.6"],
            depends=sorted(glob.glob("csrc/**/*.h", recursive=True)),
        )
    ],
    cmdclass={"build_ext": BuildWithTorchBridge},
)
