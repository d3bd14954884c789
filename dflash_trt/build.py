"""`dflash-trt build`: checkpoints in, an engine directory (and model repository) out.

Steps: resolve sources -> validate the pair -> pack weights -> copy the tokenizer ->
render the Triton repository. Everything is written into a temporary sibling directory
and renamed at the end, so a failed build leaves nothing half-written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.resources
import json
import os
import shutil
import sys
import tempfile
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from dflash_trt.errors import BuildError, ConfigError

# The top-level build_configs/ is installed as this package (see pyproject.toml).
PRESET_DIR = Path(str(importlib.resources.files("dflash_trt.build_configs")))
ENGINE_FILE = "engine.json"
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "generation_config.json")


@dataclass(frozen=True)
class BuildConfig:
    """Everything a build decides; presets and CLI flags set these fields by name."""

    target: str = ""  # local directory or Hugging Face id; empty: the embedded demo pair
    drafter: str = ""
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu (CPU bf16 matmuls are slow)
    device: str = "cpu"  # where the engine will run
    max_batch_size: int = 8  # concurrent sequences in the engine
    max_input_len: int = 2048  # prompt tokens
    max_output_len: int = 1024  # generated tokens per request
    block_size: int = 0  # 0: the drafter's trained block size
    triton_max_batch_size: int = 64  # Triton-level batching of pre/postprocessing
    preset: str = ""  # name of the preset this came from, for the record

    def __post_init__(self):
        problems = []
        if self.dtype not in DTYPES + ("auto",):
            problems.append(f"dtype must be one of auto, {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            problems.append(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        for name in ("max_batch_size", "max_input_len", "max_output_len", "triton_max_batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                problems.append(f"{name} must be an int > 0, got {getattr(self, name)!r}")
        if not isinstance(self.block_size, int) or self.block_size < 0 or self.block_size == 1:
            problems.append(f"block_size must be 0 (the drafter's) or an int >= 2, got {self.block_size!r}")
        if bool(self.target) != bool(self.drafter):
            problems.append("give both target and drafter, or neither (the embedded demo pair)")
        if problems:
            raise ConfigError("; ".join(problems))

    @property
    def max_seq_len(self) -> int:
        return self.max_input_len + self.max_output_len

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.resolved_dtype)

    @classmethod
    def from_mapping(cls, data: dict, source: str) -> "BuildConfig":
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(known)}")
        for key, value in data.items():
            expected = int if known[key] == "int" else str
            if not isinstance(value, expected) or isinstance(value, bool):
                raise ConfigError(f"{source}: key '{key}' must be {expected.__name__}, got {value!r}")
        try:
            return cls(**data)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def load_config_file(path: Path) -> dict:
    try:
        return tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None


def resolve_config(preset: str | None = None, config_file: Path | None = None, **overrides) -> BuildConfig:
    """Preset (or config file), then non-None overrides on top, validated once."""
    data, source = {}, "build options"
    if preset:
        if preset not in preset_names():
            raise ConfigError(f"unknown preset {preset!r}; presets: {', '.join(preset_names())}")
        source = str(PRESET_DIR / f"{preset}.toml")
        data = {**load_config_file(Path(source)), "preset": preset}
    elif config_file:
        data, source = load_config_file(config_file), str(config_file)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return BuildConfig.from_mapping(data, source)


# -- sources --------------------------------------------------------------------------------


def resolve_source(source: str, role: str) -> Path:
    """A local directory, or a Hugging Face id found in the local HF cache (no download)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if source.count("/") != 1 or source.startswith((".", "/", "~")) or path.exists():
        raise BuildError(f"{role} {source!r}: not a directory and not a Hugging Face id (org/name)")
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub")
    repo = hub.expanduser() / f"models--{source.replace('/', '--')}"
    ref = repo / "refs" / "main"
    snapshot = repo / "snapshots" / ref.read_text().strip() if ref.exists() else None
    if snapshot is None or not (snapshot / "config.json").exists():
        raise BuildError(
            f"{role} {source!r} is not in the local Hugging Face cache ({repo}) and dflash-trt does not download; "
            f"fetch it first (huggingface-cli download {source}) or pass a local directory"
        )
    return snapshot


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _source_record(directory: Path) -> dict:
    """What the build read, so a changed checkpoint can be noticed later."""
    files = sorted(p for p in directory.iterdir() if p.suffix == ".json" or p.name.endswith(".safetensors"))
    return {"path": str(directory.resolve()), "sha256": {p.name: _hash_file(p) for p in files}}


# -- build ------------------------------------------------------------------------------------


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _demo_sources(workdir: Path) -> tuple[Path, Path]:
    from dflash_trt.fixtures import DEMO_SPEC, write_tiny_pair

    _log("no checkpoints given: writing the embedded demo pair (tiny random weights, real Qwen tokenizer)")
    pair = write_tiny_pair(workdir / "demo-sources", DEMO_SPEC)
    return pair.target, pair.drafter


def _save_model(model, directory: Path, config_src: Path) -> None:
    from dflash_trt.fixtures import write_safetensors

    directory.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        if (config_src / name).exists():
            shutil.copy(config_src / name, directory / name)
    # Tied lm_head shares the embedding's storage; safetensors stores each tensor once.
    tensors = {name: t.detach().cpu() for name, t in model.state_dict().items()
               if not (name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False))}
    shard_count = max(1, -(-sum(t.numel() * t.element_size() for t in tensors.values()) // (4 << 30)))
    write_safetensors(directory, tensors, shard_count)


def _copy_tokenizer(target_dir: Path, out: Path) -> None:
    present = [name for name in TOKENIZER_FILES if (target_dir / name).exists()]
    if "tokenizer.json" not in present:
        raise BuildError(f"{target_dir}: no tokenizer.json; the engine needs the target's tokenizer files")
    out.mkdir(parents=True)
    for name in present:
        shutil.copy(target_dir / name, out / name)


def run(config: BuildConfig, output: Path, force: bool = False) -> Path:
    """Build the engine directory and the Triton model repository at `output`."""
    from dflash_trt.engine import load_drafter, load_target
    from dflash_trt.tokenizer import Tokenizer

    output = Path(output)
    if output.exists() and not force:
        raise BuildError(f"{output} already exists; pass --force to overwrite it")
    output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        if config.target:
            target_src = resolve_source(config.target, "target")
            drafter_src = resolve_source(config.drafter, "drafter")
        else:
            target_src, drafter_src = _demo_sources(work)
        _log(f"validating the pair: {target_src} + {drafter_src}")
        target = load_target(target_src, "cpu", config.torch_dtype)
        drafter = load_drafter(drafter_src, target, "cpu", config.torch_dtype)
        Tokenizer.from_dir(target_src)  # fails early, naming the file, if the tokenizer is broken
        engine_dir = work / "out" / "engine"
        _log(f"packing weights (fused qkv and gate_up, cast to {config.resolved_dtype})")
        _save_model(target, engine_dir / "target", target_src)
        _save_model(drafter, engine_dir / "drafter", drafter_src)
        _copy_tokenizer(target_src, engine_dir / "tokenizer")
        plugin = _place_plugins(config, engine_dir)
        record = {
            "build_config": dataclasses.asdict(config),
            "block_size": config.block_size or drafter.config.block_size,
            "sources": {"target": _source_record(target_src), "drafter": _source_record(drafter_src)},
            "versions": _versions(),
            "plugins": plugin,  # None: no GPU build; the engine runs the PyTorch reference ops
        }
        (engine_dir / ENGINE_FILE).write_text(json.dumps(record, indent=2) + "\n")
        _render_repository(engine_dir, work / "out" / "model_repository", config)
        if output.exists():
            shutil.rmtree(output)
        os.replace(work / "out", output)
        return output
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _place_plugins(config: BuildConfig, engine_dir: Path) -> str | None:
    """Compile the CUDA plugins for this GPU (a cached ninja build) and keep a copy in the engine."""
    if config.device != "cuda":
        return None
    import torch

    from dflash_trt import plugins

    if not torch.cuda.is_available():
        raise BuildError("--device cuda needs a visible CUDA GPU to compile the plugins for its architecture")
    built = plugins.load()
    if built is None:
        raise BuildError("the CUDA plugins could not be built (see the compiler output above)")
    major, minor = torch.cuda.get_device_capability()
    target = engine_dir / "plugins" / f"sm{major}{minor}" / "libdflash_plugins.so"
    target.parent.mkdir(parents=True)
    shutil.copy(built, target)
    _log(f"CUDA plugins for sm{major}{minor}: {target.relative_to(engine_dir)}")
    return str(target.relative_to(engine_dir))


def _render_repository(engine_dir: Path, repo_dir: Path, config: BuildConfig) -> None:
    try:
        from dflash_trt.repository import render_repository
    except ImportError:
        return  # the Triton repository is added by the serving work; engines still build without it
    render_repository(engine_dir, repo_dir, config)


def _versions() -> dict:
    import torch

    from dflash_trt import __version__

    return {"dflash_trt": __version__, "torch": torch.__version__, "python": sys.version.split()[0]}


# -- load -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedEngine:
    engine: object  # dflash_trt.engine.Engine
    tokenizer: object  # dflash_trt.tokenizer.Tokenizer
    config: BuildConfig
    block_size: int


def load_engine(engine_dir: Path, device: str | None = None) -> LoadedEngine:
    """Load a built engine directory (`out/engine`) onto `device` (default: the build's)."""
    from dflash_trt.engine import Engine, load_drafter, load_target
    from dflash_trt.tokenizer import Tokenizer

    engine_dir = Path(engine_dir)
    path = engine_dir / ENGINE_FILE
    try:
        record = json.loads(path.read_text())
        config = BuildConfig.from_mapping(record["build_config"], str(path))
    except FileNotFoundError:
        raise BuildError(f"{path}: not found; is {engine_dir} an engine directory from `dflash-trt build`?") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise BuildError(f"{path}: not a valid engine record ({e!r})") from None
    device = device or config.device
    target = load_target(engine_dir / "target", device, config.torch_dtype)
    drafter = load_drafter(engine_dir / "drafter", target, device, config.torch_dtype)
    if record["block_size"] != drafter.config.block_size:
        drafter.config = dataclasses.replace(drafter.config, block_size=record["block_size"])
    engine = Engine(target, drafter, max_batch_size=config.max_batch_size, max_seq_len=config.max_seq_len)
    return LoadedEngine(engine, Tokenizer.from_dir(engine_dir / "tokenizer"), config, record["block_size"])
