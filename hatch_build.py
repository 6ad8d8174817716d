"""Builds the policy's oneDNN convolution (learner/ops/native/) when the package is built.

hatchling runs this hook for wheels and for the editable install that
scripts/setup.sh makes. It compiles learner/ops/native/onednn_conv.cc against
the XLA FFI headers that jaxlib carries and oneDNN's headers and library
(onednn-devel-cpu-gomp), all build requirements in pyproject.toml, into
learner/ops/native/libseedrl_onednn.so. Linux x86_64 only, where the
onednn-cpu-gomp wheel exists. Where it cannot build (another platform, no C++
compiler), the package installs without it and the policy's convolutions stay
on XLA's own kernels (learner/ops/onednn_conv.py says why at run time).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "learner/ops/native/onednn_conv.cc"
LIBRARY = "learner/ops/native/libseedrl_onednn.so"


def _headers_and_library() -> tuple[Path, Path, Path] | str:
    """(XLA FFI include dir, oneDNN include dir, oneDNN lib dir), or why they are missing."""
    jaxlib = importlib.util.find_spec("jaxlib")
    if jaxlib is None or not jaxlib.submodule_search_locations:
        return "jaxlib is not installed in the build environment"
    xla = Path(next(iter(jaxlib.submodule_search_locations))) / "include"
    prefix = Path(sysconfig.get_paths()["data"])
    dnnl_include, dnnl_lib = prefix / "include", prefix / "lib"
    if not (xla / "xla/ffi/api/ffi.h").exists():
        return f"no XLA FFI headers under {xla}"
    if not (dnnl_include / "oneapi/dnnl/dnnl.hpp").exists():
        return f"no oneDNN headers under {dnnl_include} (onednn-devel-cpu-gomp)"
    if not (dnnl_lib / "libdnnl.so.3").exists():
        return f"no libdnnl.so.3 under {dnnl_lib} (onednn-cpu-gomp)"
    return xla, dnnl_include, dnnl_lib


def build(root: Path) -> str | None:
    """Compiles the library under `root` unless it is newer than its source; None when built,
    else why not."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"oneDNN's wheels are for Linux x86_64, not {sys.platform} {platform.machine()}"
    source, library = root / SOURCE, root / LIBRARY
    if library.exists() and library.stat().st_mtime >= source.stat().st_mtime:
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return "no C++ compiler (g++, or $CXX)"
    found = _headers_and_library()
    if isinstance(found, str):
        return found
    xla, dnnl_include, dnnl_lib = found
    temporary = library.with_suffix(".so.tmp")
    command = [
        compiler,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        f"-isystem{xla}",
        f"-isystem{dnnl_include}",
        str(source),
        "-o",
        str(temporary),
        f"-L{dnnl_lib}",
        "-l:libdnnl.so.3",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        temporary.unlink(missing_ok=True)
        return f"{' '.join(command)} failed:\n{result.stderr[-4000:]}"
    temporary.replace(library)
    return None


class CustomBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        why_not = build(Path(self.root))
        if why_not is not None:
            self.app.display_warning(
                f"seedrl: the policy's oneDNN convolution is not built ({why_not}); "
                "its convolutions will run on XLA's own kernels"
            )
            return
        if version != "editable":
            # A compiled library: the wheel is for this platform, and carries the file
            # though .gitignore lists it.
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
            build_data["artifacts"].append(LIBRARY)
