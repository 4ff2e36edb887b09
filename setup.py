"""Builds waterwave._C, the C++17 allocator core, simulator and benchmarks.

Needs neither torch nor a CUDA toolkit: the core talks to a device interface;
the simulator is compiled here, and the CUDA backend only declares the few
driver types it uses and opens libcuda at run time.
"""
import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("WATERWAVE_BUILD_JOBS", default=0).install()

sources = sorted(
    glob.glob("csrc/core/*.cpp")
    + glob.glob("csrc/device/sim/*.cpp")
    + glob.glob("csrc/device/cuda/*.cpp")
    + glob.glob("csrc/bench/*.cpp")
    + glob.glob("csrc/planner/*.cpp")
    + glob.glob("csrc/bindings/*.cpp")
)


class BuildExt(build_ext):
    """Links against the shared libstdc++ even where the interpreter's own
    build flags say -static-libstdc++ (some standalone Pythons do): a second,
    static copy of libstdc++ in _C crashes in iostreams once torch has loaded
    the shared one (seen on the GPU machine: a segfault in std::codecvt)."""

    def build_extensions(self):
        for attr in ("linker_so", "linker_so_cxx", "compiler_so", "compiler_cxx"):
            cmd = getattr(self.compiler, attr, None)
            if isinstance(cmd, list) and "-static-libstdc++" in cmd:
                setattr(self.compiler, attr, [a for a in cmd if a != "-static-libstdc++"])
        super().build_extensions()


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
            depends=sorted(glob.glob("csrc/**/*.h", recursive=True)),
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
