"""`dflash-trt build`: checkpoints in, an engine directory (and model repository) out.

Steps: resolve sources -> validate the pair -> pack weights -> copy the tokenizer ->
render the Triton repository. Everything is written into a temporary sibling directory
and renamed at the end, so a failed build leaves nothing half-written. The output carries a
marker file (MARKER); --force replaces only a directory holding that marker and nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

import torch

from dflash_trt import __version__, draft_vocab, parallel, plugins
from dflash_trt.benchmark.datasets import dataset_path, load_prompts
from dflash_trt.config import ENGINE_FILE, TOKENIZER_DIR, BuildConfig
from dflash_trt.engine import check_draft_window
from dflash_trt.errors import BuildError, ConfigError
from dflash_trt.fixtures import DEMO_DIR
from dflash_trt.loading import load_drafter, load_target, torch_dtype
from dflash_trt.serving.repository import render_repository
from dflash_trt.tokenizer import Tokenizer
from dflash_trt.training.data import INDEX_FILE, TokenDataset
from dflash_trt.weights import write_safetensors

MARKER = ".dflash-trt-build"  # written into every output: what proves --force may replace it
OUTPUT_ENTRIES = ("engine", "model_repository")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "generation_config.json")

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


def _demo_sources() -> tuple[Path, Path]:
    _log("no checkpoints given: the embedded demo pair (a small Qwen3 target trained on Python's standard library "
         "and GSM8K / HumanEval solutions, and its DFlash drafter trained by `dflash-trt train`; bench/train_demo.py)")
    return DEMO_DIR / "target", DEMO_DIR / "drafter"


def _save_model(model, directory: Path, config_src: Path) -> None:
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


def _is_marked(directory: Path) -> bool:
    try:
        return json.loads((directory / MARKER).read_text()).get("tool") == "dflash-trt"
    except (OSError, ValueError, AttributeError):
        return False


def _check_output(output: Path, force: bool) -> None:
    """Refuse an output that is not a build's to create or replace, before any work is done.

    --force must never delete a user's files: it replaces only a directory that a build made
    (its marker) and that holds nothing a build did not write."""
    if not os.path.lexists(output):
        blocker = next(p for p in output.parents if p.exists())  # "." or "/" at the latest
        if not blocker.is_dir():
            raise BuildError(f"cannot create {output}: {blocker} is not a directory; choose another -o")
        if output.name == "..":  # "x/.." where x does not exist yet: no name to rename to
            raise BuildError(f"cannot create {output}: name the output directory itself; choose another -o")
        return
    remedy = "choose another -o, or remove it yourself"
    if output.is_symlink():  # replacing it would replace the link, not what it points to
        raise BuildError(f"{output} is a symbolic link, not a directory a build made; {remedy}")
    here = Path.cwd().resolve()
    if output.resolve() in (here, *here.parents, Path(os.path.expanduser("~")).resolve()):
        raise BuildError(f"{output} is the current directory, one of its parents or the home directory; "
                         "a build never replaces it: choose another -o")
    if not output.is_dir():
        raise BuildError(f"{output} exists and is not a directory; {remedy}")
    foreign = sorted(p.name for p in output.iterdir() if p.name not in (*OUTPUT_ENTRIES, MARKER))
    if foreign:
        raise BuildError(f"{output} holds files that dflash-trt build did not write ({', '.join(foreign[:5])}"
                         f"{', ...' if len(foreign) > 5 else ''}); {remedy}")
    if not _is_marked(output):
        raise BuildError(f"{output} was not made by dflash-trt build (no {MARKER} marker); {remedy}")
    if not force:
        raise BuildError(f"{output} already exists; pass --force to overwrite it")


@contextlib.contextmanager
def _sigterm_unwinds():
    """SIGTERM's default action ends the process without running `finally` blocks, which would
    leave the temporary sibling behind. For the build it raises SystemExit(143) (128 + SIGTERM,
    what a shell reports) instead. Only the main thread may set handlers, and a handler the
    caller installed (or SIG_IGN) is theirs: it is left alone."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _swap_in(new: Path, output: Path, aside: Path) -> None:
    """Rename the finished build `new` to `output`. An old output is renamed to `aside` first
    and deleted only once the new one is in place, so at every point one of them is complete
    (a crash between the renames leaves both whole, in hidden siblings); if the new one cannot
    move in, the old one is renamed back."""
    try:
        if output.exists():
            os.replace(output, aside)
        try:
            os.replace(new, output)
        except BaseException:
            if os.path.lexists(aside):
                os.replace(aside, output)
            raise
    except OSError as e:
        raise BuildError(f"cannot move the new build into {output}: {e.strerror or e}") from e
    shutil.rmtree(aside, ignore_errors=True)


def run(config: BuildConfig, output: Path, force: bool = False) -> Path:
    """Build the engine directory and the Triton model repository at `output`."""
    output = Path(output)
    with _sigterm_unwinds():
        try:
            _check_output(output, force)
            output.parent.mkdir(parents=True, exist_ok=True)
            work = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        except OSError as e:  # a read-only or unreadable directory: a user's problem, not a crash
            raise BuildError(f"cannot write {output}: {e.strerror or e}") from e
        try:
            _build_into(config, work)
            _check_output(output, force)  # again: the directory may have changed during a long build
            # The old output goes beside `work`, not into it: if it cannot be renamed back,
            # the cleanup below must not delete it.
            _swap_in(work / "out", output, work.with_name(work.name + ".old"))
            return output
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _build_into(config: BuildConfig, work: Path) -> None:
    """Write the whole output to `work/out` (scratch files, such as the demo pair, go in `work`)."""
    if config.target:
        target_src = resolve_source(config.target, "target")
        drafter_src = resolve_source(config.drafter, "drafter")
    else:
        target_src, drafter_src = _demo_sources()
    _log(f"validating the pair: {target_src} + {drafter_src}")
    target = load_target(target_src, "cpu", torch_dtype(config))
    drafter = load_drafter(drafter_src, target, "cpu", torch_dtype(config))
    check_draft_window(config.draft_window_size, config.block_size or drafter.config.block_size)
    if config.tensor_parallel > 1:
        parallel.check_supported(target.config, config.tensor_parallel)
        parallel.check_supported(drafter.config, config.tensor_parallel)
    tokenizer = Tokenizer.from_dir(target_src)  # fails early, naming the file, if the tokenizer is broken
    engine_dir = work / "out" / "engine"
    _log(f"packing weights (fused qkv and gate_up, cast to {config.resolved_dtype})")
    _save_model(target, engine_dir / "target", target_src)
    _save_model(drafter, engine_dir / "drafter", drafter_src)
    if config.draft_vocab_size:
        _write_draft_vocab(config, target, tokenizer, engine_dir / "drafter")
    elif drafter.vocab_ids is not None:  # the source drafter's own pruning (validated while loading it)
        draft_vocab.write(engine_dir / "drafter", drafter.vocab_ids.tolist())
    _copy_tokenizer(target_src, engine_dir / TOKENIZER_DIR)
    _compile_plugins(config)
    record = {
        "build_config": dataclasses.asdict(config),
        "block_size": config.block_size or drafter.config.block_size,
        "sources": {"target": _source_record(target_src), "drafter": _source_record(drafter_src)},
        "versions": _versions(),
    }
    (engine_dir / ENGINE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    render_repository(engine_dir, work / "out" / "model_repository", config)
    marker = {"tool": "dflash-trt", "version": __version__, "contents": list(OUTPUT_ENTRIES)}
    (work / "out" / MARKER).write_text(json.dumps(marker) + "\n")


def _token_counts(source: str, tokenizer: Tokenizer) -> Counter:
    """Token frequencies of a token dataset directory (`train`'s OUTPUT/data), a JSONL of
    prompts (or a shipped set's name), or a plain text file."""
    path = Path(source)
    if (path / INDEX_FILE).is_file():
        return Counter(TokenDataset(path).tokens.tolist())
    if str(source).endswith(".jsonl") or not path.exists():
        dataset_path(source)  # names the file when it is neither a set nor a file
        return Counter(t for p in load_prompts(source) for t in tokenizer.encode(p))
    try:
        return Counter(tokenizer.encode(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read a draft-vocabulary corpus ({e})") from None


def _write_draft_vocab(config: BuildConfig, target, tokenizer: Tokenizer, drafter_dir: Path) -> None:
    counts = _token_counts(config.draft_vocab_corpus, tokenizer)
    ids = draft_vocab.choose(counts, config.draft_vocab_size, tokenizer.stop_token_ids, target.config.vocab_size)
    covered = sum(counts[i] for i in ids) / max(1, sum(counts.values()))
    _log(f"draft vocabulary: {len(ids)} of {target.config.vocab_size} tokens, {covered:.1%} of the corpus's tokens")
    draft_vocab.write(drafter_dir, ids)


def _compile_plugins(config: BuildConfig) -> None:
    """A GPU build compiles the CUDA plugins for this GPU now (a cached ninja build, see
    plugins.py), so a build that cannot run them fails here, not at the first request."""
    if config.device != "cuda":
        return
    if not torch.cuda.is_available():
        raise BuildError("--device cuda needs a visible CUDA GPU to compile the plugins for its architecture")
    if plugins.load() is None:
        raise BuildError("the CUDA plugins could not be built (see the compiler output above)")


def _versions() -> dict:
    return {"dflash_trt": __version__, "torch": torch.__version__, "python": sys.version.split()[0]}
