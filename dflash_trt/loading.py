"""Loading, in one place: checkpoints -> models, and engine directories -> a ready engine.

A checkpoint directory (Hugging Face layout) becomes a target or drafter module with its
weights packed as the model wants them (`load_target`, `load_drafter`, `load_pair`). An engine
directory (what `dflash-trt build` writes) becomes a `LoadedEngine`: the engine, its tokenizer
and the build config recorded in engine.json (`config.read_engine_record`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_trt import draft_vocab, parallel
from dflash_trt.config import (
    TOKENIZER_DIR,
    BuildConfig,
    DraftConfig,
    check_pair,
    read_engine_record,
)
from dflash_trt.engine import Engine
from dflash_trt.errors import ConfigError, PairError
from dflash_trt.models import load_target_config, target_class
from dflash_trt.models.dflash import DFlashDrafter
from dflash_trt.models.qwen3 import Qwen3ForCausalLM
from dflash_trt.tokenizer import Tokenizer
from dflash_trt.weights import Checkpoint, load_weights


def torch_dtype(config: BuildConfig) -> torch.dtype:
    return getattr(torch, config.resolved_dtype)


# -- checkpoints ----------------------------------------------------------------------------


def empty_model(model_cls, config, device, dtype) -> torch.nn.Module:
    """The model with uninitialised weights on `device` (built on "meta": nothing allocated
    twice), its tied weights tied."""
    with torch.device("meta"):
        model = model_cls(config)
    model = model.to(dtype)
    if torch.device(device).type == "cuda":
        check_weights_fit(model, torch.device(device))
    model = model.to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model


def check_weights_fit(model: torch.nn.Module, device: torch.device) -> None:
    """Refuse a model whose weights exceed the GPU's free memory before allocating any (the
    397B MoE in bf16 needs several GPUs), rather than failing with an out-of-memory error
    halfway through loading."""
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        raise ConfigError(
            f"the {type(model).__name__} weights take {need / 2**30:.1f} GiB but {device} has {free / 2**30:.1f} GiB "
            "free: shard it over several GPUs (build --tensor-parallel N)")


def _build(model_cls, config, checkpoint: Checkpoint, device, dtype, prefixes=("",), group=None, fsdp=None):
    """The model with its weights; with a tensor-parallel `group`, this rank's shard, read
    tensor by tensor (parallel.plan), never the whole model; with an `fsdp` device mesh, each
    decoder layer's weights sharded over it (shard_layers), read the same way."""
    if group is None and fsdp is None:
        model = empty_model(model_cls, config, device, dtype)
        load_weights(model, checkpoint, prefixes)
        return model.eval()
    with torch.device("meta"):
        model = model_cls(config).to(dtype)
    if fsdp is not None:
        shard_layers(model, fsdp)
        model = model.to_empty(device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    load_weights(model, checkpoint, prefixes, cuts=parallel.plan(model, group) if group else None, device=device)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # a tensor-parallel embedding's new shard, into the LM head as well
    return model.eval()


def load_target(directory: Path, device="cpu", dtype=torch.float32, group=None, fsdp=None) -> Qwen3ForCausalLM:
    """`group`: a tensor-parallel rank's (parallel.Group), for its shard only. `fsdp`: a device
    mesh to shard the decoder layers over (training a drafter for a target one device cannot
    hold)."""
    config = load_target_config(directory)
    return _build(target_class(config.model_type), config, Checkpoint(directory), device, dtype, group=group,
                  fsdp=fsdp)


def target_skeleton(directory: Path) -> Qwen3ForCausalLM:
    """The target's modules on "meta": its config and shapes, no weight read or allocated
    (enough to pair a drafter with it and read the drafter's own weights)."""
    config = load_target_config(directory)
    with torch.device("meta"):
        return target_class(config.model_type)(config)


def shard_layers(model: torch.nn.Module, mesh) -> None:
    """FSDP (fully_shard) over each decoder layer of `model`: every rank keeps 1/N of a layer's
    weights and gathers the whole layer for its forward only, so every rank must run the same
    passes in the same order. The embedding, final norm and LM head stay whole on every rank:
    a drafter borrows them, and they are a small part of a large target."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)


def load_drafter(directory: Path, target: Qwen3ForCausalLM, device="cpu", dtype=torch.float32,
                 group=None) -> DFlashDrafter:
    config = DraftConfig.from_dir(directory, target.config.dims.num_hidden_layers)
    check_pair(target.config, config, directory)
    checkpoint = Checkpoint(directory)
    # z-lab drafters store flat names; some exports add a "model." prefix. Any stray
    # embed_tokens / lm_head tensors are ignored: the drafter always uses the target's.
    prefixes = ("", "model.")
    fc_name = checkpoint.resolve("fc.weight", prefixes)
    width = checkpoint.get(fc_name).shape[-1]
    expected = config.num_taps * target.config.dims.hidden_size
    if width != expected:
        raise PairError(
            f"{checkpoint.files[fc_name]}: '{fc_name}' has input width {width}, but {config.num_taps} taps x "
            f"hidden_size {target.config.dims.hidden_size} = {expected}"
        )
    drafter = _build(DFlashDrafter, config, checkpoint, device, dtype, prefixes, group)
    drafter.bind(target)
    vocab = draft_vocab.read(directory, target.config.vocab_size)
    if vocab is not None:
        if group is not None:
            raise ConfigError(f"{Path(directory) / draft_vocab.FILE}: a pruned draft vocabulary with tensor "
                              "parallelism is not supported yet")
        drafter.prune_vocab(torch.tensor(vocab, dtype=torch.long))
    return drafter


def load_pair(target_dir, drafter_dir=None, *, device="cpu", dtype=torch.float32,
              max_batch_size: int = 8, max_seq_len: int = 4096, mode: str | None = None,
              draft_window: int = 0) -> Engine:
    """Load a Qwen3 target (and optionally its DFlash drafter) into an Engine."""
    target = load_target(Path(target_dir), device, dtype)
    drafter = load_drafter(Path(drafter_dir), target, device, dtype) if drafter_dir else None
    return Engine(target, drafter, max_batch_size=max_batch_size, max_seq_len=max_seq_len, mode=mode,
                  draft_window=draft_window)


# -- engine directories -----------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedEngine:
    engine: Engine
    tokenizer: Tokenizer
    config: BuildConfig


def load_engine(engine_dir: Path, device: str | None = None, draft_window: int | None = None,
                tensor_parallel: int | None = None) -> LoadedEngine:
    """Load a built engine directory (`out/engine`) onto `device` (default: the build's), with
    the build's draft window and tensor-parallel ranks unless given (the directory holds whole
    weights: each rank cuts its shard while loading)."""
    engine_dir = Path(engine_dir)
    record, config = read_engine_record(engine_dir)
    device = device or config.device
    if draft_window is not None:
        config = dataclasses.replace(config, draft_window_size=draft_window)
    if tensor_parallel is not None:
        config = dataclasses.replace(config, tensor_parallel=tensor_parallel)
    engine_class = Engine
    if config.tensor_parallel > 1:
        # this process is rank 0 unless a follower (parallel._follower_main) joined the group first
        parallel.check_supported(load_target_config(engine_dir / "target"), config.tensor_parallel)  # before spawning
        parallel.join_as_leader(engine_dir, config.tensor_parallel, device, draft_window)
        engine_class = parallel.Leader if dist.get_rank() == 0 else Engine
    group = parallel.Group.current() if config.tensor_parallel > 1 else None
    target = load_target(engine_dir / "target", device, torch_dtype(config), group)
    drafter = load_drafter(engine_dir / "drafter", target, device, torch_dtype(config), group)
    engine = engine_class(target, drafter, max_batch_size=config.max_batch_size, max_seq_len=config.max_seq_len,
                          block_size=record["block_size"], draft_window=config.draft_window_size,
                          prefill_chunk=config.prefill_chunk_size, verify_width=config.verify_width,
                          overlap=config.overlap)
    return LoadedEngine(engine, Tokenizer.from_dir(engine_dir / TOKENIZER_DIR), config)
