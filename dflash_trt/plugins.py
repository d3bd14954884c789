"""Build and load the CUDA plugins (plugins/*.cu, ops.cpp) as torch ops under torch.ops.dflash.

The library is compiled once per GPU architecture and source hash with ninja into
plugins/ under the cache directory (`config.cache_dir()`: $DFLASH_TRT_CACHE, default
~/.cache/dflash-trt) and reused after that. On a machine without a CUDA GPU, or with
DFLASH_TRT_PLUGINS=0 (logged: every op then runs its PyTorch reference), `load()` returns
None and ops.py uses the PyTorch references.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from dflash_trt.config import cache_dir

log = logging.getLogger(__name__)

# one library; ops.cpp holds the registrations
SOURCES = ("ops.cpp", "block_attention.cu", "layer_ops.cu", "gated_delta.cu", "gemv.cu", "moe.cu", "moe_route.cu",
           "random.cu")
NAME = "dflash_trt_plugins"


def plugin_dir() -> Path:
    """plugins/ in a source checkout (next to the package), else the copy installed inside it."""
    checkout = Path(__file__).resolve().parent.parent / "plugins"
    if (checkout / SOURCES[0]).is_file():
        return checkout
    installed = Path(__file__).resolve().parent / "plugin_sources"  # a wheel install (see pyproject.toml)
    if (installed / SOURCES[0]).is_file():
        return installed
    raise FileNotFoundError("plugins/ sources not found in the checkout or the installed package")


def source_hash(directory: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(directory.iterdir()):
        if path.suffix in (".cu", ".cpp", ".h", ".cuh"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]




@functools.cache
def load():
    """The loaded library's path, or None where the plugins cannot run (no CUDA GPU)."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return None
    if os.environ.get("DFLASH_TRT_PLUGINS", "1") == "0":
        log.warning("DFLASH_TRT_PLUGINS=0: the CUDA plugins are off; every op runs its PyTorch reference")
        return None
    # Only a GPU build needs it, and it needs setuptools and a compiler on import.
    from torch.utils import cpp_extension

    major, minor = torch.cuda.get_device_capability()
    src = plugin_dir()
    # torch and CUDA versions are part of the key: the library links against both.
    key = f"sm{major}{minor}-torch{torch.__version__}-cu{torch.version.cuda}-{source_hash(src)}"
    build_dir = cache_dir() / "plugins" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    # Build only for this GPU (cpp_extension reads the arch list from the environment).
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    try:
        path = cpp_extension.load(
            name=NAME,
            sources=[str(src / s) for s in SOURCES],
            extra_include_paths=[str(src)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo"],
            build_directory=str(build_dir),
            is_python_module=False,  # TORCH_LIBRARY registers torch.ops.dflash.* on load
            verbose=os.environ.get("DFLASH_TRT_VERBOSE_BUILD") == "1",
        )
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved
    return path


def nvcc_path() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").is_file():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def compile_check(source: str | os.PathLike, arch: str = "sm_90") -> subprocess.CompletedProcess:
    """Compile one .cu alone with `nvcc -c` (no torch, no GPU needed): CI's build check."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    source = Path(source)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-std=c++17", f"-arch={arch}", "-I", str(source.parent), "-c", str(source),
               "-o", str(Path(tmp) / (source.stem + ".o"))]
        return subprocess.run(cmd, capture_output=True, text=True)
