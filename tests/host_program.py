"""Build and run a small host program against the plugin headers (no GPU needed): how the
tests check that a Python mirror of a C++ rule (which head sizes a kernel runs) agrees."""

import subprocess
from pathlib import Path

import pytest

from dflash_trt import plugins

PLUGINS = Path(__file__).resolve().parent.parent / "plugins"


def run_host_program(tmp_path: Path, source: str) -> str:
    """Compile `source` (C++ including plugin headers) with nvcc, run it, return its stdout."""
    if plugins.nvcc_path() is None:
        pytest.skip("nvcc not found")
    (tmp_path / "main.cpp").write_text(source)
    build = subprocess.run([plugins.nvcc_path(), "-std=c++17", "-I", str(PLUGINS), str(tmp_path / "main.cpp"),
                            "-o", str(tmp_path / "main")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return subprocess.run([str(tmp_path / "main")], capture_output=True, text=True, check=True).stdout
