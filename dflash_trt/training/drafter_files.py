"""A drafter on disk in the z-lab layout: the config of a new one for a target, its first
weights, and the trained weights written back under the released names (`build` loads the
result like a downloaded drafter)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_trt.config import default_target_layer_ids
from dflash_trt.errors import ConfigError
from dflash_trt.models.dflash import DFlashDrafter
from dflash_trt.models.layers import PackedLinear
from dflash_trt.weights import write_safetensors

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class DrafterShape:
    """What `train` chooses for a new drafter; the rest follows the target."""

    block_size: int = 16
    num_layers: int = 1
    target_layer_ids: tuple[int, ...] | None = None  # None: the z-lab default formula
    mask_token_id: int | None = None  # None: the first embedding row the tokenizer does not use
    sliding_window: int | None = None  # with sliding_layers: their window
    sliding_layers: tuple[int, ...] = ()
    intermediate_size: int | None = None  # None: the target's MLP width


def new_drafter_config(target_config: dict, tokenizer_vocab: int, shape: DrafterShape) -> dict:
    """The config.json of a new drafter for a target (its text config as a dict): Qwen3 layers
    of the target's width and heads, a mask token and the tapped layers."""
    text = target_config.get("text_config", target_config)
    num_target_layers = text["num_hidden_layers"]
    vocab = text["vocab_size"]
    mask = shape.mask_token_id if shape.mask_token_id is not None else tokenizer_vocab
    if not 0 <= mask < vocab:
        raise ConfigError(f"mask_token_id = {mask} is outside the target's vocabulary of {vocab} rows"
                          + ("" if shape.mask_token_id is not None else
                             " (the tokenizer uses every row: pass --mask-token-id)"))
    taps = shape.target_layer_ids or default_target_layer_ids(shape.num_layers, num_target_layers)
    if not all(0 <= t < num_target_layers for t in taps):
        raise ConfigError(f"target_layer_ids = {list(taps)}: the target has layers 0..{num_target_layers - 1}")
    if shape.block_size < 2:
        raise ConfigError(f"block_size = {shape.block_size} must be at least 2")
    bad = [i for i in shape.sliding_layers if not 0 <= i < shape.num_layers]
    if bad or (shape.sliding_layers and not shape.sliding_window):
        raise ConfigError(f"sliding layers {list(shape.sliding_layers)} need a --sliding-window and must be in "
                          f"0..{shape.num_layers - 1}")
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    intermediate = shape.intermediate_size or text.get("intermediate_size") or 3 * text["hidden_size"]
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": text["hidden_size"],
        "intermediate_size": intermediate,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": text["num_attention_heads"],
        "num_key_value_heads": text["num_key_value_heads"],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": text.get("rms_norm_eps", 1e-6),
        "rope_theta": text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta", 1e6),
        "rope_scaling": None,
        "max_position_embeddings": text.get("max_position_embeddings", 4096),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "vocab_size": vocab,
        "block_size": shape.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(taps)},
        "torch_dtype": "bfloat16",
    }
    if shape.sliding_layers:
        config["layer_types"] = ["sliding_attention" if i in shape.sliding_layers else "full_attention"
                                 for i in range(shape.num_layers)]
        config["sliding_window"] = shape.sliding_window
    return config


def initial_tensors(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """First weights under the z-lab names: normal(0, 0.02) projections (Hugging Face's
    initializer_range) and unit norms."""
    gen = torch.Generator().manual_seed(seed)
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    taps = len(config["dflash_config"]["target_layer_ids"])
    lin = lambda out, inp: torch.randn(out, inp, generator=gen) * 0.02  # noqa: E731
    tensors = {"fc.weight": lin(h, taps * h), "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"layers.{layer}."
        tensors.update({
            f"{p}input_layernorm.weight": torch.ones(h), f"{p}post_attention_layernorm.weight": torch.ones(h),
            f"{p}self_attn.q_proj.weight": lin(q, h), f"{p}self_attn.k_proj.weight": lin(kv, h),
            f"{p}self_attn.v_proj.weight": lin(kv, h), f"{p}self_attn.o_proj.weight": lin(h, q),
            f"{p}self_attn.q_norm.weight": torch.ones(d), f"{p}self_attn.k_norm.weight": torch.ones(d),
            f"{p}mlp.gate_proj.weight": lin(i, h), f"{p}mlp.up_proj.weight": lin(i, h),
            f"{p}mlp.down_proj.weight": lin(h, i),
        })
    return tensors


def checkpoint_tensors(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """The drafter's weights under the z-lab names: fused projections split back into the
    checkpoint's (qkv_proj -> q/k/v_proj, gate_up_proj -> gate/up_proj)."""
    tensors = {}
    for module_name, module in drafter.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for leaf, param in module.named_parameters(recurse=False):
            if isinstance(module, PackedLinear):
                owner = prefix.rsplit(".", 2)[0]  # "layers.0.self_attn.qkv_proj." -> "layers.0.self_attn"
                for (name, rows), part in zip(module.shards.items(), param.split(list(module.shards.values()))):
                    tensors[f"{owner}.{name}.{leaf}"] = part.detach()
            else:
                tensors[f"{prefix}{leaf}"] = param.detach()
    return tensors


def write_drafter(directory: Path, config: dict, tensors: dict[str, torch.Tensor],
                  dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json and model.safetensors into `directory`, each replaced whole (written
    beside it, then renamed): a reader never sees half a drafter."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".write-") as tmp:
        staged = Path(tmp)
        write_safetensors(staged, {n: t.float().cpu() for n, t in tensors.items()}, dtype=dtype)
        (staged / CONFIG_FILE).write_text(json.dumps({**config, "torch_dtype": str(dtype).removeprefix("torch.")},
                                                     indent=2) + "\n")
        for name in ("model.safetensors", CONFIG_FILE):
            os.replace(staged / name, directory / name)

