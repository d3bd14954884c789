"""Render the Triton model repository from the `triton_repo/` templates, strictly, at build time.

Each `config.pbtxt` is a `string.Template` filled with `substitute` (never `safe_substitute`):
a placeholder without a value fails the build, naming the template and the key, instead of
surviving as a literal `${...}` for runtime code to trip over. The tensor blocks and the
ensemble wiring are generated from `protocol.py`, so names are defined once; the templates
hold only the Triton-level knobs (backend, batching, decoupled policy, instances).

How the models find the engine: the `engine_dir` parameter holds the engine directory
*relative to the model's directory* (`../../engine` for the layout `build` writes). `build`
renders into a temporary directory that it renames at the end, so an absolute path taken at
render time would point into that temporary directory; a relative one also survives moving or
copying the whole output directory. Edit the parameter to an absolute path to serve a
repository that sits elsewhere.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import string
from pathlib import Path

from dflash_trt.errors import BuildError, ConfigError
from dflash_trt.serving import protocol as p

CONFIG_FILE = "config.pbtxt"
ENGINE_DIR_PARAMETER = "engine_dir"
VERSION = "1"
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "__init__.py")


def template_dir() -> Path:
    # The top-level triton_repo/ is installed as this package (see pyproject.toml).
    return Path(str(importlib.resources.files("dflash_trt.triton_repo")))


def render_repository(engine_dir: Path, repo_dir: Path, config, *, templates: Path | None = None) -> None:
    """Write the model repository for the engine at `engine_dir` into `repo_dir` (must not exist
    or be empty). `config` is the BuildConfig the engine was built with."""
    templates = Path(templates) if templates else template_dir()
    repo_dir = Path(repo_dir)
    if repo_dir.exists() and any(repo_dir.iterdir()):
        raise BuildError(f"{repo_dir}: the model repository directory is not empty")
    for model in p.MODELS:
        source = templates / model
        if not (source / CONFIG_FILE).is_file():
            raise BuildError(f"{source / CONFIG_FILE}: template missing from the installed dflash_trt package")
        shutil.copytree(source, repo_dir / model, ignore=_SKIP, dirs_exist_ok=True)
        (repo_dir / model / VERSION).mkdir(exist_ok=True)  # Triton needs a version directory, even for the ensemble
        values = template_values(model, Path(engine_dir), repo_dir, config)
        target = repo_dir / model / CONFIG_FILE
        target.write_text(fill_template(source / CONFIG_FILE, values), encoding="utf-8")


def fill_template(path: Path, values: dict) -> str:
    try:
        return string.Template(path.read_text(encoding="utf-8")).substitute(values)
    except KeyError as e:
        raise BuildError(f"{path}: template key '{e.args[0]}' has no value "
                         f"(values given: {', '.join(sorted(values))})") from None
    except ValueError as e:  # a malformed placeholder, e.g. a stray "$"
        raise BuildError(f"{path}: malformed template ({e})") from None


def template_values(model: str, engine_dir: Path, repo_dir: Path, config) -> dict[str, str]:
    model_dir = (repo_dir / model).resolve()
    return {
        "triton_max_batch_size": str(config.triton_max_batch_size),
        "inputs": tensor_block(p.MODEL_INPUTS[model], inputs=True),
        "outputs": tensor_block(p.MODEL_OUTPUTS[model], inputs=False),
        "ensemble_steps": ensemble_steps(p.ENSEMBLE_STEPS),
        ENGINE_DIR_PARAMETER: os.path.relpath(Path(engine_dir).resolve(), model_dir),
    }


def tensor_block(specs, inputs: bool) -> str:
    entries = []
    for spec in specs:
        lines = [f'    name: "{spec.name}"', f"    data_type: TYPE_{spec.dtype}",
                 f"    dims: [ {', '.join(map(str, spec.dims))} ]"]
        if inputs and spec.optional:  # outputs have no such field; any output may be left out
            lines.append("    optional: true")
        entries.append("  {\n" + "\n".join(lines) + "\n  }")
    return ",\n".join(entries)


def ensemble_steps(steps) -> str:
    rendered = []
    for step in steps:
        lines = [f'      model_name: "{step.model}"', "      model_version: -1"]
        lines += [f'      input_map {{ key: "{k}" value: "{v}" }}' for k, v in step.inputs]
        lines += [f'      output_map {{ key: "{k}" value: "{v}" }}' for k, v in step.outputs]
        rendered.append("    {\n" + "\n".join(lines) + "\n    }")
    return ",\n".join(rendered)


# `serve --draft-window-size` and `--tensor-parallel` reach the dflash model through
# tritonserver's environment.
DRAFT_WINDOW_ENV = "DFLASH_TRT_DRAFT_WINDOW_SIZE"
TENSOR_PARALLEL_ENV = "DFLASH_TRT_TENSOR_PARALLEL"


def draft_window_from_env() -> int | None:
    """The draft window `serve` asked for, or None: the build's."""
    return _int_from_env(DRAFT_WINDOW_ENV, 0)


def tensor_parallel_from_env() -> int | None:
    """The tensor-parallel ranks `serve` asked for, or None: the build's."""
    return _int_from_env(TENSOR_PARALLEL_ENV, 1)


def _int_from_env(name: str, least: int) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    if not value.isdigit() or int(value) < least:
        raise ConfigError(f"{name} must be an int >= {least}, got {value!r}")
    return int(value)


def engine_dir_from_args(args: dict) -> Path:
    """The engine directory a Triton Python model should load, from its `initialize` args."""
    model_dir = Path(args["model_repository"])
    try:
        value = json.loads(args["model_config"])["parameters"][ENGINE_DIR_PARAMETER]["string_value"]
    except (KeyError, TypeError, json.JSONDecodeError):
        raise ConfigError(f"{model_dir / CONFIG_FILE}: parameter '{ENGINE_DIR_PARAMETER}' is missing") from None
    path = (model_dir / value).resolve()  # an absolute value stays as it is
    if not path.is_dir():
        raise ConfigError(
            f"{model_dir / CONFIG_FILE}: {ENGINE_DIR_PARAMETER} '{value}' resolves to {path}, which is not a "
            f"directory; keep model_repository/ next to engine/ as `dflash-trt build` writes them, or set the "
            f"parameter to the engine's absolute path"
        )
    return path
