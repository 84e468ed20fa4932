"""Builds ktorch._C: one torch extension, with the ISA kernels compiled separately under their own flags.

The kernels under ktorch/csrc/kernels/<isa>/ include no ATen headers; each folder becomes a static library
built by setuptools' build_clib with that ISA's -m flags, and the extension (op registration, the MoE driver,
the runtime) is compiled for the baseline ISA and links them all. Which kernels run is decided at run time
from CPUID (ktorch/csrc/runtime/dispatch.cpp), so the extension imports on any x86-64 CPU.
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("ktorch", "csrc")
OPT = ["-O3", "-std=c++17", "-fPIC", "-fno-math-errno"]

ISA_FLAGS = {
    "portable": [],
    "avx2": ["-mavx2", "-mfma"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mfma"],
    "amx": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mfma",
            "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
}


def isa_library(isa):
    sources = sorted(glob.glob(os.path.join(CSRC, "kernels", isa, "*.cpp")))
    deps = {src: glob.glob(os.path.join(CSRC, "kernels", "**", "*.h"), recursive=True) for src in sources}
    return (f"kt_kernels_{isa}", {"sources": sources, "cflags": OPT + ISA_FLAGS[isa], "obj_deps": deps})


class BuildExt(BuildExtension):
    """Builds the ISA static libraries first (editable installs do not run build_clib on their own)."""

    def run(self):
        self.run_command("build_clib")
        clib = self.get_finalized_command("build_clib")
        for ext in self.extensions:
            ext.library_dirs.append(clib.build_clib)
        super().run()


ext_sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "moe", "*.cpp"))
                     + glob.glob(os.path.join(CSRC, "runtime", "*.cpp")) + glob.glob(os.path.join(CSRC, "formats", "*.cpp")))
libraries = [isa_library(isa) for isa in ISA_FLAGS]


def runtime_libraries_of_torch():
    """The shared libstdc++ and libgomp this (torch-importing) process runs with, to link against explicitly.

    Some toolchains (seen: a g++ under /opt/gcc on the device machine) link libstdc++ statically into a
    shared object by default. The extension then carries its own iostream/locale state beside torch's, and
    formatting a number into a c10::str message (every TORCH_CHECK naming a shape) crashes on mismatched
    locale facets. Naming torch's own shared copies before the driver's implicit -lstdc++ resolves every
    symbol there, so nothing is pulled from a static archive.
    """
    found = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            for name in ("libstdc++.so", "libgomp"):
                if name in os.path.basename(path) and name not in found and os.path.exists(path):
                    found[name] = path
    return ["-Wl,--no-as-needed"] + list(found.values()) + ["-Wl,--as-needed"] if found else []

# KT_PREBUILT_EXTENSION=<path of a _C*.so built from this same source with this same torch>: install without
# compiling (the device runner builds once per source id and reuses the result; see scripts/device.py).
prebuilt = os.environ.get("KT_PREBUILT_EXTENSION")
if prebuilt:
    import shutil

    # (no SystemExit after this setup(): pip's PEP 660 hooks run this file in-process and would lose their output)
    shutil.copy(prebuilt, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ktorch", os.path.basename(prebuilt)))
    setup()
else:
    setup(
        libraries=libraries,
        ext_modules=[
            CppExtension(
                "ktorch._C",
                ext_sources,
                # ATen's at::parallel_for is a header template: without OpenMP here it would run serially
                extra_compile_args=OPT + ["-fopenmp"],
                # the kernels reference each other (amx falls back to avx512), so group them for the linker
                extra_link_args=runtime_libraries_of_torch() + ["-fopenmp", "-Wl,--start-group"] + [f"-l{name}" for name, _ in libraries] + ["-Wl,--end-group"],
            )
        ],
        cmdclass={"build_ext": BuildExt},
    )
