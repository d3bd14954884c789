"""A wheel install carries everything the runtime reads from disk (no source checkout)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True)
    return next(out.glob("dflash_trt-*.whl"))


def test_wheel_ships_plugin_sources_presets_templates_datasets_and_the_demo_pair(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ROOT.glob("plugins/*"):
        if path.suffix in (".cu", ".h", ".cpp"):
            assert f"dflash_trt/plugin_sources/{path.name}" in names
    assert "dflash_trt/build_configs/qwen3-8b-b16.toml" in names
    assert "dflash_trt/triton_repo/dflash/1/model.py" in names
    assert "dflash_trt/benchmark/datasets/gsm8k.jsonl" in names
    for path in ROOT.glob("dflash_trt/fixtures/demo/*/*"):
        assert str(path.relative_to(ROOT)) in names


def test_wheel_ships_every_module_of_the_package(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [str(path.relative_to(ROOT)) for path in (ROOT / "dflash_trt").rglob("*.py")
               if "__pycache__" not in path.parts and str(path.relative_to(ROOT)) not in names]
    assert not missing, f"pyproject.toml's packages leave out {missing}"


def test_installed_wheel_finds_its_plugin_sources(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    code = "from dflash_trt import plugins; d = plugins.plugin_dir(); print(d); print(plugins.source_hash(d))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True).stdout.split()
    assert Path(out[0]).is_relative_to(site)
    from dflash_trt import plugins

    assert out[1] == plugins.source_hash(ROOT / "plugins"), "the installed sources are the checkout's"
