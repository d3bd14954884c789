"""Real-shape Qwen3 / Qwen3.5 + DFlash pairs with random weights, made directly on the device.

Benchmarks at real sizes need no checkpoint download: the configs and the real Qwen3
tokenizer are written to a small directory (the loaders then validate them like any
checkpoint), and the tensors are filled in place on the GPU instead of writing and reading
gigabytes of noise. Random drafters accept almost nothing, so speed numbers from these
pairs come with oracle acceptance (bench.py) and say so.

Shapes are those of the released checkpoints' config.json files (Qwen/Qwen3-*); the
drafters are z-lab's layout: 5 Qwen3 layers, block 16, taps from the default formula
(for 36 target layers [1, 9, 17, 25, 33], as Qwen3-8B-DFlash-b16 lists).

qwen3.5-9b is Qwen/Qwen3.5-9B's text model (32 layers, every 4th full attention with
16/4 heads of 256, Gated DeltaNet 16/32 heads of 128, vocabulary 248,320) with a drafter of
z-lab's Qwen3.5 layout: 5 layers, 32/8 heads of 128, taps [1, 8, 15, 22, 29], RoPE theta
1e7 (its intermediate size is not published; the target's is used).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import torch

from dflash_trt.config import BuildConfig, DraftConfig, check_pair
from dflash_trt.engine import Engine
from dflash_trt.errors import ConfigError
from dflash_trt.fixtures.pair import PairPaths, TinyPairSpec, write_tiny_pair
from dflash_trt.loading import LoadedEngine, empty_model
from dflash_trt.models import load_target_config, target_class
from dflash_trt.models.dflash import DFlashDrafter
from dflash_trt.tokenizer import Tokenizer

_QWEN3 = dict(num_heads=32, num_kv_heads=8, head_dim=128, draft_layers=5, block_size=16, rope_theta=1e6,
              draft_rope_theta=1e6, target_layer_ids=None, tokenizer_tokens=151643, vocab_size=151936,
              dtype="bfloat16", init_scale=1.0)

PRESETS: dict[str, TinyPairSpec] = {
    "qwen3-8b": TinyPairSpec(hidden_size=4096, intermediate_size=12288, num_layers=36, **_QWEN3),
    "qwen3-4b": TinyPairSpec(hidden_size=2560, intermediate_size=9728, num_layers=36, tie_word_embeddings=True,
                             **_QWEN3),
    "qwen3-1.7b": TinyPairSpec(hidden_size=2048, intermediate_size=6144, num_layers=28, tie_word_embeddings=True,
                               **{**_QWEN3, "num_heads": 16}),
    "qwen3.5-9b": TinyPairSpec(
        target_type="qwen3_5", hidden_size=4096, intermediate_size=12288, num_layers=32, num_heads=16,
        num_kv_heads=4, head_dim=256, linear_heads=(16, 32), linear_head_dims=(128, 128), conv_kernel_size=4,
        partial_rotary_factor=0.25, multimodal=True, draft_layers=5, block_size=16,
        target_layer_ids=(1, 8, 15, 22, 29), rope_theta=1e7, draft_rope_theta=1e7, tokenizer_tokens=248044,
        vocab_size=248320, dtype="bfloat16",
        extra_draft_config={"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                            "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 8, 15, 22, 29]}}),
}


def preset_spec(name: str) -> TinyPairSpec:
    if name not in PRESETS:
        raise ConfigError(f"unknown random-weights preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def write_configs(directory: Path, name: str, dtype: torch.dtype = torch.bfloat16) -> PairPaths:
    """The pair's config.json files and tokenizer, without weights."""
    spec = dataclasses.replace(preset_spec(name), dtype=str(dtype).removeprefix("torch."))
    return write_tiny_pair(Path(directory), spec, weights=False)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """Fill every parameter in place, with the scales fixtures/pair.py uses for tiny pairs:
    norms near 1, linear weights with std scale/sqrt(fan_in), so activations stay O(1)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, device=p.device))
        elif "embed_tokens" in name:
            p.copy_(scale * torch.randn(p.shape, generator=gen, device=p.device))
        else:
            std = (4 if name.startswith("lm_head") else 1) * scale / p.shape[1] ** 0.5
            p.copy_(std * torch.randn(p.shape, generator=gen, device=p.device))


def random_pair(sources: PairPaths, device, dtype, seed: int = 0):
    """Target and bound drafter from `sources` (configs only), with random weights on `device`."""
    target_config = load_target_config(sources.target)
    draft_config = DraftConfig.from_dir(sources.drafter, target_config.dims.num_hidden_layers)
    check_pair(target_config, draft_config, sources.drafter)
    models = []
    target_cls = target_class(target_config.model_type)
    for cls, config, model_seed in ((target_cls, target_config, seed), (DFlashDrafter, draft_config, seed + 1)):
        model = empty_model(cls, config, device, dtype)
        randomize(model, model_seed)
        models.append(model.eval())
    target, drafter = models
    drafter.bind(target)
    return target, drafter


def random_engine(preset: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, max_batch_size: int = 32,
                  max_seq_len: int = 4096, seed: int = 0):
    """A LoadedEngine (engine + tokenizer) for a random-weights preset, built on `device`."""
    with tempfile.TemporaryDirectory(prefix="dflash-random-") as tmp:
        sources = write_configs(Path(tmp), preset, dtype)
        target, drafter = random_pair(sources, device, dtype, seed)
        tokenizer = Tokenizer.from_dir(sources.target)
    engine = Engine(target, drafter, max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    config = BuildConfig(device=str(torch.device(device).type), dtype=str(dtype).removeprefix("torch."),
                         max_batch_size=max_batch_size, max_input_len=max(1, max_seq_len // 2),
                         max_output_len=max(1, max_seq_len - max_seq_len // 2), preset=f"random:{preset}")
    return LoadedEngine(engine, tokenizer, config)
