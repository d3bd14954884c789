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

The MoE presets (Qwen3.5/3.6 MoE text models, values of the released config.json files):
qwen3.6-35b-a3b (= qwen3.5-35b-a3b's shapes): 40 layers, hidden 2048, 16/2 heads of 256,
Gated DeltaNet 16/32 heads of 128, 256 experts, top 8, expert width 512, shared expert 512;
its drafter as z-lab's Qwen3.5-35B-A3B-DFlash: 8 layers, hidden 2048, intermediate 6144,
32/4 heads of 128, taps [1, 10, 19, 28, 37]. qwen3.5-397b-a17b: 60 layers, hidden 4096,
32/2 heads of 256, Gated DeltaNet 16/64 heads of 128, 512 experts, top 10, width 1024,
shared 1024; its drafter is not published, so it is assumed in the 35B-A3B drafter's layout
scaled to hidden 4096 (8 layers, intermediate 12288, 32/4 heads of 128, 5 taps). The 397B
does not fit one GPU in bf16: `num_layers` builds a reduced-depth copy (its taps clamped
into range) for per-layer measurements.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import torch

from dflash_trt.config import BuildConfig, DraftConfig, check_pair, default_target_layer_ids
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
# Qwen3.5-27B's target as THUDM/slime's scripts/models/qwen3.5-27B.sh gives it (64 layers,
# 3 linear : 1 full, 24/4 heads of 256), with 48 value heads in its linear layers (the
# qwen3.5-27b-b16 preset's memory note); its drafter in the 9B drafter's layout (5 layers, 32/8
# heads of 128) over the default formula's taps: shapes for timing, not a released checkpoint.
PRESETS["qwen3.5-27b"] = TinyPairSpec(
    target_type="qwen3_5", hidden_size=5120, intermediate_size=17408, num_layers=64, num_heads=24, num_kv_heads=4,
    head_dim=256, linear_heads=(16, 48), linear_head_dims=(128, 128), conv_kernel_size=4, partial_rotary_factor=0.25,
    multimodal=True, draft_layers=5, block_size=16, target_layer_ids=(1, 16, 31, 46, 61), rope_theta=1e7,
    draft_rope_theta=1e7, tokenizer_tokens=248044, vocab_size=248320, dtype="bfloat16",
    extra_draft_config={"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                        "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}})
_QWEN3_5_MOE = dict(target_type="qwen3_5", num_kv_heads=2, head_dim=256, linear_head_dims=(128, 128),
                    conv_kernel_size=4, partial_rotary_factor=0.25, multimodal=True, block_size=16, rope_theta=1e7,
                    draft_rope_theta=1e7, tokenizer_tokens=248044, vocab_size=248320, dtype="bfloat16")


def _qwen3_5_moe(taps: tuple[int, ...], **shape) -> TinyPairSpec:
    """A Qwen3.5 MoE target with a drafter in the 35B-A3B drafter's layout (8 layers, 32/4 heads
    of 128), tapping `taps`."""
    drafter = {"num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
               "dflash_config": {"mask_token_id": 248070, "target_layer_ids": list(taps)}}
    return TinyPairSpec(draft_layers=8, target_layer_ids=taps, extra_draft_config=drafter, **_QWEN3_5_MOE, **shape)


PRESETS["qwen3.6-35b-a3b"] = _qwen3_5_moe(
    (1, 10, 19, 28, 37), hidden_size=2048, intermediate_size=6144, num_layers=40, num_heads=16, linear_heads=(16, 32),
    num_experts=256, experts_per_tok=8, moe_intermediate_size=512, shared_expert_size=512)
PRESETS["qwen3.5-35b-a3b"] = PRESETS["qwen3.6-35b-a3b"]
PRESETS["qwen3.5-397b-a17b"] = _qwen3_5_moe(
    (1, 15, 29, 43, 57), hidden_size=4096, intermediate_size=12288, num_layers=60, num_heads=32, linear_heads=(16, 64),
    num_experts=512, experts_per_tok=10, moe_intermediate_size=1024, shared_expert_size=1024)


def preset_spec(name: str, num_layers: int | None = None) -> TinyPairSpec:
    """The preset's spec; `num_layers` a reduced-depth copy, its taps clamped into range."""
    if name not in PRESETS:
        raise ConfigError(f"unknown random-weights preset {name!r}; presets: {', '.join(PRESETS)}")
    spec = PRESETS[name]
    if num_layers is None or num_layers == spec.num_layers:
        return spec
    if not 1 <= num_layers <= spec.num_layers:
        raise ConfigError(f"num_layers = {num_layers}: preset {name!r} has 1 to {spec.num_layers} layers")
    full_taps = spec.target_layer_ids or default_target_layer_ids(spec.draft_layers, spec.num_layers)
    taps = tuple(sorted({min(t, num_layers - 1) for t in full_taps}))
    extra = dict(spec.extra_draft_config)
    if "dflash_config" in extra:
        extra["dflash_config"] = {**extra["dflash_config"], "target_layer_ids": list(taps)}
    return dataclasses.replace(spec, num_layers=num_layers, target_layer_ids=taps, layer_types=None,
                               extra_draft_config=extra)


def write_configs(directory: Path, name: str, dtype: torch.dtype = torch.bfloat16,
                  num_layers: int | None = None) -> PairPaths:
    """The pair's config.json files and tokenizer, without weights."""
    spec = dataclasses.replace(preset_spec(name, num_layers), dtype=str(dtype).removeprefix("torch."))
    return write_tiny_pair(Path(directory), spec, weights=False)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """Fill every parameter in place, with the scales fixtures/pair.py uses for tiny pairs:
    norms near 1, linear weights with std scale/sqrt(fan_in), so activations stay O(1). A
    random router spreads every token's picks uniformly over the experts: the most distinct
    experts a pass can touch, the worst case for reading them."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, device=p.device))
        elif "embed_tokens" in name:
            p.copy_(scale * torch.randn(p.shape, generator=gen, device=p.device))
        else:  # fan-in is the last dim (also of the packed [E, out, in] experts)
            std = (4 if name.startswith("lm_head") else 1) * scale / p.shape[-1] ** 0.5
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
                  max_seq_len: int = 4096, seed: int = 0, num_layers: int | None = None, draft_window: int = 0):
    """A LoadedEngine (engine + tokenizer) for a random-weights preset, built on `device`
    (`num_layers`: a reduced-depth copy of the preset)."""
    with tempfile.TemporaryDirectory(prefix="dflash-random-") as tmp:
        sources = write_configs(Path(tmp), preset, dtype, num_layers)
        target, drafter = random_pair(sources, device, dtype, seed)
        tokenizer = Tokenizer.from_dir(sources.target)
    engine = Engine(target, drafter, max_batch_size=max_batch_size, max_seq_len=max_seq_len, draft_window=draft_window,
                    verify_width=BuildConfig.verify_width)  # a build's default
    config = BuildConfig(device=str(torch.device(device).type), dtype=str(dtype).removeprefix("torch."),
                         max_batch_size=max_batch_size, max_input_len=max(1, max_seq_len // 2),
                         draft_window_size=draft_window,
                         max_output_len=max(1, max_seq_len - max_seq_len // 2), preset=f"random:{preset}")
    return LoadedEngine(engine, tokenizer, config)
