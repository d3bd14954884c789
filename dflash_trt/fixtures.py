"""Tiny random-weight target + drafter pairs in the exact Hugging Face on-disk layout.

Tests use them for parity and losslessness; the same generator makes the embedded demo
pair that `dflash-trt build` uses when no checkpoint is given. The tokenizer is the real
Qwen byte-level BPE (its first N merges), written by `dflash_trt.tokenizer`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_trt.config import default_target_layer_ids


@dataclass(frozen=True)
class TinyPairSpec:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    tie_word_embeddings: bool = False
    num_shards: int = 1
    rope_theta: float = 1e6
    # "qwen3_5": a Qwen3.5 hybrid target (Gated DeltaNet + gated attention) instead of Qwen3
    target_type: str = "qwen3"
    layer_types: tuple[str, ...] | None = None  # hybrid layer kinds; None: every 4th layer full attention
    linear_heads: tuple[int, int] = (2, 4)  # Gated DeltaNet (key/query heads, value heads)
    linear_head_dims: tuple[int, int] = (16, 16)  # (key head dim, value head dim)
    conv_kernel_size: int = 4
    partial_rotary_factor: float = 0.25
    multimodal: bool = True  # the released layout: text_config + model.language_model.* (+ vision, mtp)
    # drafter
    draft_layers: int = 2
    block_size: int = 8
    target_layer_ids: tuple[int, ...] | None = (0, 2)  # None: leave them out, use the default formula
    draft_layer_types: tuple[str, ...] | None = None  # None: all full attention
    sliding_window: int | None = None
    draft_rope_theta: float = 1e6
    draft_prefix: str = ""  # "model." mimics exports that prefix the flat names
    stray_embeddings: bool = False  # early uploads shipped embed_tokens / lm_head in the drafter
    block_size_in_dflash_config: bool = False
    # vocabulary: a real Qwen tokenizer with this many regular tokens, or none at all
    tokenizer_tokens: int | None = 1000
    vocab_size: int | None = None  # without a tokenizer the vocabulary size must be given
    seed: int = 0
    # Larger than HF's 0.02 so tiny random models have well-separated logits (greedy
    # comparisons would otherwise hinge on near-ties).
    init_scale: float = 1.0
    dtype: str = "float32"  # stored dtype of the weight files
    extra_draft_config: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class PairPaths:
    target: Path
    drafter: Path


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _normal(gen, *shape, std):
    return torch.randn(*shape, generator=gen) * std


def _norm_weight(gen, size):
    return 1.0 + _normal(gen, size, std=0.1)


def _layer_tensors(gen, spec: TinyPairSpec, prefix: str, scale: float) -> dict[str, torch.Tensor]:
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    lin = lambda out, inp: _normal(gen, out, inp, std=scale / inp**0.5)  # noqa: E731
    return {
        f"{prefix}input_layernorm.weight": _norm_weight(gen, h),
        f"{prefix}post_attention_layernorm.weight": _norm_weight(gen, h),
        f"{prefix}self_attn.q_proj.weight": lin(q, h),
        f"{prefix}self_attn.k_proj.weight": lin(kv, h),
        f"{prefix}self_attn.v_proj.weight": lin(kv, h),
        f"{prefix}self_attn.o_proj.weight": lin(h, q),
        f"{prefix}self_attn.q_norm.weight": _norm_weight(gen, d),
        f"{prefix}self_attn.k_norm.weight": _norm_weight(gen, d),
        f"{prefix}mlp.gate_proj.weight": lin(i, h),
        f"{prefix}mlp.up_proj.weight": lin(i, h),
        f"{prefix}mlp.down_proj.weight": lin(h, i),
    }


def target_tensors(spec: TinyPairSpec, vocab_size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed)
    h = spec.hidden_size
    tensors = {"model.embed_tokens.weight": _normal(gen, vocab_size, h, std=spec.init_scale)}
    for layer in range(spec.num_layers):
        tensors.update(_layer_tensors(gen, spec, f"model.layers.{layer}.", spec.init_scale))
    tensors["model.norm.weight"] = _norm_weight(gen, h)
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = _normal(gen, vocab_size, h, std=4 * spec.init_scale / h**0.5)
    return tensors


def _hybrid_layer_types(spec: TinyPairSpec) -> list[str]:
    return list(spec.layer_types or ["linear_attention" if (i + 1) % 4 else "full_attention"
                                     for i in range(spec.num_layers)])


def hybrid_target_tensors(spec: TinyPairSpec, vocab_size: int) -> dict[str, torch.Tensor]:
    """Qwen3.5 hybrid weights under their HF names (zero-centred norms: weight ~ 0)."""
    gen = torch.Generator().manual_seed(spec.seed)
    h, i, d, s = spec.hidden_size, spec.intermediate_size, spec.head_dim, spec.init_scale
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    (hk, hv), (dk, dv) = spec.linear_heads, spec.linear_head_dims
    conv = 2 * hk * dk + hv * dv
    lin = lambda out, inp: _normal(gen, out, inp, std=s / inp**0.5)  # noqa: E731
    small = lambda *shape: _normal(gen, *shape, std=0.1)  # noqa: E731
    base = "model.language_model." if spec.multimodal else "model."
    tensors = {f"{base}embed_tokens.weight": _normal(gen, vocab_size, h, std=s)}
    for layer, kind in enumerate(_hybrid_layer_types(spec)):
        p = f"{base}layers.{layer}."
        tensors[f"{p}input_layernorm.weight"] = small(h)
        tensors[f"{p}post_attention_layernorm.weight"] = small(h)
        if kind == "linear_attention":
            tensors.update({
                f"{p}linear_attn.in_proj_qkv.weight": lin(conv, h),
                f"{p}linear_attn.in_proj_z.weight": lin(hv * dv, h),
                f"{p}linear_attn.in_proj_b.weight": lin(hv, h),
                f"{p}linear_attn.in_proj_a.weight": lin(hv, h),
                f"{p}linear_attn.conv1d.weight": _normal(gen, conv, 1, spec.conv_kernel_size,
                                                         std=s / spec.conv_kernel_size**0.5),
                f"{p}linear_attn.dt_bias": 1.0 + small(hv),
                f"{p}linear_attn.A_log": torch.empty(hv).uniform_(0.5, 8.0, generator=gen).log(),
                f"{p}linear_attn.norm.weight": _norm_weight(gen, dv),
                f"{p}linear_attn.out_proj.weight": lin(h, hv * dv),
            })
        else:
            tensors.update({
                f"{p}self_attn.q_proj.weight": lin(2 * q, h),  # per head: query rows, then gate rows
                f"{p}self_attn.k_proj.weight": lin(kv, h),
                f"{p}self_attn.v_proj.weight": lin(kv, h),
                f"{p}self_attn.o_proj.weight": lin(h, q),
                f"{p}self_attn.q_norm.weight": small(d),
                f"{p}self_attn.k_norm.weight": small(d),
            })
        tensors.update({f"{p}mlp.gate_proj.weight": lin(i, h), f"{p}mlp.up_proj.weight": lin(i, h),
                        f"{p}mlp.down_proj.weight": lin(h, i)})
    tensors[f"{base}norm.weight"] = small(h)
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = _normal(gen, vocab_size, h, std=4 * s / h**0.5)
    if spec.multimodal:  # parts the text runtime must skip: a vision tower and the MTP head
        tensors["model.visual.patch_embed.proj.weight"] = small(16, 3, 2, 4, 4)
        tensors["mtp.fc.weight"] = lin(h, 2 * h)
    return tensors


def _hybrid_target_config(spec: TinyPairSpec, vocab_size: int, bos, eos) -> dict:
    """config.json of a Qwen3.5 target, in the released multimodal layout or text-only."""
    (hk, hv), (dk, dv) = spec.linear_heads, spec.linear_head_dims
    text = {
        "model_type": "qwen3_5_text",
        **_layer_config(spec, spec.num_layers, spec.rope_theta),
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta,
                            "partial_rotary_factor": spec.partial_rotary_factor},
        "layer_types": _hybrid_layer_types(spec),
        "linear_num_key_heads": hk, "linear_num_value_heads": hv,
        "linear_key_head_dim": dk, "linear_value_head_dim": dv,
        "linear_conv_kernel_dim": spec.conv_kernel_size,
        "attn_output_gate": True,
        "vocab_size": vocab_size,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }
    del text["rope_theta"], text["rope_scaling"]  # transformers 5 keeps RoPE in rope_parameters
    if not spec.multimodal:
        return {"architectures": ["Qwen3_5ForCausalLM"], **text}
    vision = {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 16, "intermediate_size": 32,
              "num_heads": 2, "patch_size": 4, "temporal_patch_size": 2, "out_hidden_size": spec.hidden_size}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "vision_config": vision, "tie_word_embeddings": spec.tie_word_embeddings}


def drafter_tensors(spec: TinyPairSpec, num_taps: int, vocab_size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed + 1)
    h, p = spec.hidden_size, spec.draft_prefix
    tensors = {
        f"{p}fc.weight": _normal(gen, h, num_taps * h, std=spec.init_scale / (num_taps * h) ** 0.5),
        f"{p}hidden_norm.weight": _norm_weight(gen, h),
        f"{p}norm.weight": _norm_weight(gen, h),
    }
    for layer in range(spec.draft_layers):
        tensors.update(_layer_tensors(gen, spec, f"{p}layers.{layer}.", spec.init_scale))
    if spec.stray_embeddings:
        tensors[f"{p}embed_tokens.weight"] = torch.zeros(vocab_size, h)
        tensors["lm_head.weight"] = torch.zeros(vocab_size, h)
    return tensors


def _layer_config(spec: TinyPairSpec, num_layers: int, rope_theta: float) -> dict:
    return {
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": spec.dtype,
    }


def write_safetensors(directory: Path, tensors: dict[str, torch.Tensor], num_shards: int = 1,
                      dtype: torch.dtype | None = None) -> None:
    tensors = {name: (t.to(dtype) if dtype else t).contiguous() for name, t in tensors.items()}
    if num_shards == 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[shard::num_shards]}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_tiny_pair(directory: Path, spec: TinyPairSpec = TinyPairSpec(), *, weights: bool = True) -> PairPaths:
    """Write `directory/target` and `directory/drafter`; returns their paths.

    `weights=False` writes only the configs and the tokenizer (random_weights.py fills
    real-size models directly on the GPU instead of writing gigabytes of noise).
    """
    directory = Path(directory)
    target_dir, drafter_dir = directory / "target", directory / "drafter"
    target_dir.mkdir(parents=True, exist_ok=True)
    drafter_dir.mkdir(parents=True, exist_ok=True)

    if spec.tokenizer_tokens is not None:
        from dflash_trt.tokenizer import write_qwen_tokenizer

        family = "qwen3_5" if spec.target_type == "qwen3_5" else "qwen3"
        tok = write_qwen_tokenizer(target_dir, family=family, num_regular_tokens=spec.tokenizer_tokens)
        vocab_size = spec.vocab_size or _round_up(tok.vocab_size + 1, 64)
        mask_id, eos, pad, bos = tok.vocab_size, tok.eos_token_id, tok.pad_token_id, tok.bos_token_id
    else:
        vocab_size = spec.vocab_size
        mask_id, eos, pad, bos = vocab_size - 1, vocab_size - 2, vocab_size - 3, None

    target_config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **_layer_config(spec, spec.num_layers, spec.rope_theta),
        "vocab_size": vocab_size,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "use_sliding_window": False,
        "sliding_window": None,
    }
    if spec.target_type == "qwen3_5":
        target_config = _hybrid_target_config(spec, vocab_size, bos, eos)
    _write_json(target_dir / "config.json", target_config)
    _write_json(target_dir / "generation_config.json",
                {"bos_token_id": bos, "eos_token_id": [eos, pad], "pad_token_id": pad, "do_sample": False})
    dtype = getattr(torch, spec.dtype)
    if weights:
        tensors = hybrid_target_tensors if spec.target_type == "qwen3_5" else target_tensors
        write_safetensors(target_dir, tensors(spec, vocab_size), spec.num_shards, dtype)

    taps = spec.target_layer_ids or default_target_layer_ids(spec.draft_layers, spec.num_layers)
    dflash_config = {"mask_token_id": mask_id}
    if spec.target_layer_ids is not None:
        dflash_config["target_layer_ids"] = list(spec.target_layer_ids)
    draft_config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **_layer_config(spec, spec.draft_layers, spec.draft_rope_theta),
        "num_target_layers": spec.num_layers,
        "vocab_size": vocab_size,
        "layer_types": list(spec.draft_layer_types or ["full_attention"] * spec.draft_layers),
        "sliding_window": spec.sliding_window,
        "use_sliding_window": spec.sliding_window is not None,
        "dflash_config": dflash_config,
    }
    if spec.block_size_in_dflash_config:
        dflash_config["block_size"] = spec.block_size
    else:
        draft_config["block_size"] = spec.block_size
    draft_config.update(spec.extra_draft_config)
    _write_json(drafter_dir / "config.json", draft_config)
    if weights:
        write_safetensors(drafter_dir, drafter_tensors(spec, len(taps), vocab_size), dtype=dtype)
    _write_json(directory / "fixture.json", {k: v for k, v in asdict(spec).items() if k != "extra_draft_config"})
    return PairPaths(target_dir, drafter_dir)


# The embedded demo pair: small enough to build in seconds on a laptop CPU, with the first
# 8000 merges of the real Qwen3 tokenizer so prompts and outputs are real text.
DEMO_SPEC = TinyPairSpec(
    hidden_size=256, intermediate_size=768, num_layers=6, num_heads=8, num_kv_heads=2, head_dim=32,
    draft_layers=2, target_layer_ids=(1, 3, 4), block_size=8, tokenizer_tokens=8000, seed=2026,
)
