"""Builds the policy's oneDNN convolution (learner/backends/cpu/native/) when the package is built.

hatchling runs this hook for wheels and for the editable install that
scripts/setup.sh makes. It compiles learner/backends/cpu/native/onednn_conv.cc against
the XLA FFI headers that jaxlib carries and oneDNN's headers and library
(onednn-devel-cpu-gomp), all build requirements in pyproject.toml, into
learner/backends/cpu/native/libseedrl_onednn.so. Linux x86_64 only, where the
onednn-cpu-gomp wheel exists. Where it cannot build (another platform, no C++
compiler), the package installs without it and the policy's convolutions stay
on XLA's own kernels (learner/backends/cpu/onednn_conv.py says why at run time).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = "learner/backends/cpu/native/onednn_conv.cc"
LIBRARY = "learner/backends/cpu/native/libseedrl_onednn.so"


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
    """Compiles the library under `root`: None when built, else why not.

    It compiles every time the hook runs (about 5 s), which is whenever uv rebuilds
    the package (pyproject's cache-keys: this file, the source), so a library built
    against other headers or flags never outlives them.
    """
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"oneDNN's wheels are for Linux x86_64, not {sys.platform} {platform.machine()}"
    source, library = root / SOURCE, root / LIBRARY
    compiler = shlex.split(os.environ.get("CXX", "g++")) or ["g++"]
    if shutil.which(compiler[0]) is None:
        return f"no C++ compiler ({compiler[0]}; set $CXX)"
    found = _headers_and_library()
    if isinstance(found, str):
        return found
    xla, dnnl_include, dnnl_lib = found
    command = [
        *compiler,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        f"-isystem{xla}",
        f"-isystem{dnnl_include}",
        str(source),
        f"-L{dnnl_lib}",
        "-l:libdnnl.so.3",
    ]
    # A file of its own in the same directory, so concurrent builds do not collide and the
    # library appears whole or not at all.
    handle, name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=library.parent)
    os.close(handle)
    temporary = Path(name)
    result = subprocess.run(
        [*command, "-o", str(temporary)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        temporary.unlink(missing_ok=True)
        return f"{' '.join(command)} failed:\n{result.stderr[-4000:]}"
    temporary.chmod(0o755)
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
