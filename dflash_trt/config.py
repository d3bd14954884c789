"""Model configs: frozen dataclasses built field by field from a checkpoint's config.json.

No transformers import: the runtime reads the JSON itself, so a config that transformers
would silently patch up is rejected here with the file, key and value named.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from dflash_trt.errors import BuildError, ConfigError, PairError

LAYER_KINDS = ("full_attention", "sliding_attention")


def cache_dir() -> Path:
    """What dflash-trt caches between runs (compiled plugins, Triton backend links):
    $DFLASH_TRT_CACHE, else $XDG_CACHE_HOME/dflash-trt, else ~/.cache/dflash-trt."""
    if os.environ.get("DFLASH_TRT_CACHE"):
        return Path(os.environ["DFLASH_TRT_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "dflash-trt"


def read_json(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


class _Fields:
    """Typed access to one config.json, so every error names the file and the key."""

    def __init__(self, data: dict, path: Path, prefix: str = ""):
        # prefix: where `data` sits in the file, e.g. "text_config." for a nested config
        self.data, self.path, self.prefix = data, path, prefix

    def get(self, key, kind, default=...):
        value = self.data.get(key, default)
        if value is ...:
            raise ConfigError(f"{self.path}: required key '{self.prefix}{key}' is missing")
        if value is None and default is None:
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise ConfigError(f"{self.path}: key '{self.prefix}{key}' must be {kind.__name__}, got {value!r}")
        return value

    def positive(self, key, default=...):
        value = self.get(key, int, default)
        if value is not None and value <= 0:
            raise ConfigError(f"{self.path}: key '{self.prefix}{key}' must be > 0, got {value}")
        return value

    def error(self, key, message):
        return ConfigError(f"{self.path}: key '{self.prefix}{key}' {message}")


@dataclass(frozen=True, slots=True)
class YaRN:
    """YaRN RoPE scaling (`rope_type: "yarn"`), as transformers reads it: frequencies that
    turn fewer than `beta_slow` times over the original context are interpolated by `factor`,
    those turning more than `beta_fast` times are kept, a linear ramp in between; cos and sin
    are scaled by `attention_factor`. Qwen3.6 drafters and long-context Qwen3 set it."""

    factor: float
    original_max_position_embeddings: int
    attention_factor: float
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class LayerDims:
    """What one Qwen3 decoder layer needs; shared by the target and the drafter."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    max_position_embeddings: int
    rope_yarn: YaRN | None = None  # None: plain RoPE

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class MoEDims:
    """The sparse MLP of a mixture-of-experts target (Qwen3 MoE, Qwen3.5/3.6 MoE).

    Each token's router picks `top_k` of `num_experts` SwiGLU experts of width `expert_size`;
    their outputs are summed with the router's softmax weights (renormalised over the picks
    when `norm_topk_prob`). Qwen3.5 MoE adds a shared expert of width `shared_expert_size`
    (0: none) scaled by a sigmoid gate. Layers not in `sparse_layers` keep a dense MLP of
    `LayerDims.intermediate_size`.
    """

    num_experts: int
    top_k: int
    expert_size: int
    shared_expert_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]


def _moe_dims(f: _Fields, num_layers: int, *, shared: bool, always_renormalize: bool) -> MoEDims:
    """MoE keys as transformers reads them: Qwen3 MoE's sparse layers are those not in
    `mlp_only_layers` whose index + 1 is a multiple of `decoder_sparse_step`; Qwen3.5 MoE
    (`always_renormalize`, `shared`) has no such keys: every layer is sparse."""
    experts = f.positive("num_experts")
    top_k = f.positive("num_experts_per_tok")
    if top_k > experts:
        raise f.error("num_experts_per_tok", f"= {top_k} exceeds num_experts = {experts}")
    dense = f.get("mlp_only_layers", list, None) or []
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense):
        raise f.error("mlp_only_layers", f"must list layer indices in [0, {num_layers}), got {dense!r}")
    step = f.positive("decoder_sparse_step", 1)
    return MoEDims(
        num_experts=experts,
        top_k=top_k,
        expert_size=f.positive("moe_intermediate_size"),
        shared_expert_size=f.positive("shared_expert_intermediate_size") if shared else 0,
        norm_topk_prob=True if always_renormalize else f.get("norm_topk_prob", bool, False),
        sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
    )


def _check_unquantized(f: _Fields, *more: _Fields) -> None:
    """Quantized releases (e.g. the -FP8 checkpoints: block-scaled fp8 weights plus
    `weight_scale_inv` tensors) would load as garbage: refuse them by their config key."""
    for part in (f, *more):
        q = part.data.get("quantization_config")
        if q is not None:
            method = q.get("quant_method") if isinstance(q, dict) else q
            raise part.error("quantization_config", f"names a quantized checkpoint (quant_method {method!r}); "
                                                      "dflash-trt loads bf16/fp16/fp32 weights only: use the "
                                                      "unquantized release")


def _rope_params(f: _Fields) -> tuple[str, dict]:
    # transformers 5 writes RoPE under `rope_parameters`; older checkpoints use `rope_scaling`.
    key = "rope_parameters" if f.data.get("rope_parameters") else "rope_scaling"
    params = f.data.get(key) or {}
    if not isinstance(params, dict):
        raise f.error(key, f"must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise f.error(key, f"has rope_type {kind!r}; supported: default, yarn")
    return key, params


def _rope_yarn(f: _Fields) -> YaRN | None:
    key, params = _rope_params(f)
    if params.get("rope_type", params.get("type")) != "yarn":
        return None

    def number(name, zero_ok=False):
        """An optional number; None where absent or null (transformers' defaults apply)."""
        value = params.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or value < 0 or value == 0 and not zero_ok):
            raise f.error(f"{key}.{name}", f"must be a positive number, got {value!r}")
        return value

    # Defaults as transformers reads them: the original context is max_position_embeddings,
    # the factor the ratio of the two, beta_fast/beta_slow 32/1 (also for an explicit 0).
    max_position = f.positive("max_position_embeddings", 32768)
    original = number("original_max_position_embeddings") or max_position
    if not isinstance(original, int):
        raise f.error(f"{key}.original_max_position_embeddings", f"must be an int, got {original!r}")
    factor = number("factor") or max_position / original
    attention_factor = number("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = number("mscale", zero_ok=True), number("mscale_all_dim", zero_ok=True)
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise f.error(f"{key}.truncate", f"must be true or false, got {truncate!r}")
    return YaRN(factor=float(factor), original_max_position_embeddings=original,
                attention_factor=float(attention_factor), beta_fast=float(number("beta_fast", True) or 32),
                beta_slow=float(number("beta_slow", True) or 1), truncate=truncate)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """The YaRN paper's attention temperature: 0.1 ln(s) + 1 for a context scaled by s > 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_theta(f: _Fields) -> float:
    _, params = _rope_params(f)
    theta = f.data.get("rope_theta", params.get("rope_theta"))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise f.error("rope_theta", f"must be a positive number, got {theta!r}")
    return float(theta)


def _layer_dims(f: _Fields, dense_mlp: bool = True) -> LayerDims:
    """`dense_mlp` False: no layer has a dense MLP (Qwen3.5 MoE), so intermediate_size may be absent (0)."""
    hidden = f.positive("hidden_size")
    heads = f.positive("num_attention_heads")
    kv_heads = f.positive("num_key_value_heads", heads)
    if heads % kv_heads:
        raise f.error("num_key_value_heads", f"= {kv_heads} must divide num_attention_heads = {heads}")
    return LayerDims(
        hidden_size=hidden,
        intermediate_size=f.positive("intermediate_size") if dense_mlp or "intermediate_size" in f.data else 0,
        num_hidden_layers=f.positive("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=f.positive("head_dim", hidden // heads),
        rms_norm_eps=f.get("rms_norm_eps", float, 1e-6),
        rope_theta=_rope_theta(f),
        attention_bias=f.get("attention_bias", bool, False),
        max_position_embeddings=f.positive("max_position_embeddings", 32768),
        rope_yarn=_rope_yarn(f),
    )


def _check_activation(f: _Fields) -> None:
    act = f.data.get("hidden_act", "silu")
    if act != "silu":
        raise f.error("hidden_act", f"is {act!r}; only 'silu' (SwiGLU) is supported")


def _token_ids(f: _Fields, key: str) -> tuple[int, ...]:
    value = f.data.get(key)
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise f.error(key, f"must be an int or a list of ints, got {value!r}")
    return tuple(values)


@dataclass(frozen=True, slots=True)
class TargetConfig:
    """A Qwen3 target: dense (HF `model_type` "qwen3") or mixture of experts ("qwen3_moe")."""

    dims: LayerDims
    vocab_size: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    model_type: str = "qwen3"  # picks the model class (models.TARGETS)
    moe: MoEDims | None = None  # None: every layer has a dense MLP

    @classmethod
    def from_dir(cls, directory: Path) -> "TargetConfig":
        path = Path(directory) / "config.json"
        f = _Fields(read_json(path), path)
        model_type = f.data.get("model_type")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise f.error("model_type", f"is {model_type!r}; expected 'qwen3' or 'qwen3_moe'")
        _check_activation(f)
        _check_unquantized(f)
        eos = _token_ids(f, "eos_token_id")
        gen_path = Path(directory) / "generation_config.json"
        if gen_path.exists():
            # Qwen3 lists both <|im_end|> and <|endoftext|> here; config.json has only one.
            eos += tuple(i for i in _token_ids(_Fields(read_json(gen_path), gen_path), "eos_token_id") if i not in eos)
        dims = _layer_dims(f)
        return cls(
            dims=dims,
            vocab_size=f.positive("vocab_size"),
            tie_word_embeddings=f.get("tie_word_embeddings", bool, False),
            eos_token_ids=eos,
            model_type=model_type,
            moe=(_moe_dims(f, dims.num_hidden_layers, shared=False, always_renormalize=False)
                 if model_type == "qwen3_moe" else None),
        )


HYBRID_LAYER_KINDS = ("linear_attention", "full_attention")
# the Qwen3.5/3.6 model types: a released multimodal one -> its text model's type (a text-only
# export carries the latter at the top level)
HYBRID_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_text": "qwen3_5_text",
                     "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5_moe_text": "qwen3_5_moe_text"}


@dataclass(frozen=True, slots=True)
class LinearAttentionDims:
    """A Gated DeltaNet layer: q/k heads share `key_head_dim`, v heads `value_head_dim`."""

    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: each q/k head serves a group of v heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int

    @property
    def key_size(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_size(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_size(self) -> int:
        """Channels of the causal conv: q, k and v side by side."""
        return 2 * self.key_size + self.value_size


@dataclass(frozen=True, slots=True)
class HybridTargetConfig:
    """A Qwen3.5 / Qwen3.6 hybrid target: Gated DeltaNet layers and gated full-attention
    layers, with dense MLPs (HF `model_type` "qwen3_5", text part "qwen3_5_text") or a
    mixture of experts with a shared expert ("qwen3_5_moe", "qwen3_5_moe_text").

    `dims` holds the full-attention and MLP sizes; `dims.num_hidden_layers` counts all layers.
    """

    dims: LayerDims
    linear: LinearAttentionDims
    layer_types: tuple[str, ...]  # per layer: "linear_attention" or "full_attention"
    partial_rotary_factor: float  # RoPE turns only the first head_dim * factor channels
    vocab_size: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    has_vision: bool  # a multimodal checkpoint: its vision tower is not loaded, images are not served
    model_type: str = "qwen3_5"  # picks the model class (models.TARGETS)
    moe: MoEDims | None = None  # None: every layer has a dense MLP

    @property
    def rotary_dim(self) -> int:
        return int(self.dims.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "linear_attention")

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == "full_attention")

    @classmethod
    def from_dir(cls, directory: Path) -> "HybridTargetConfig":
        path = Path(directory) / "config.json"
        top = _Fields(read_json(path), path)
        model_type = top.data.get("model_type")
        if model_type not in HYBRID_TEXT_TYPES:
            raise top.error("model_type", f"is {model_type!r}; expected one of {', '.join(HYBRID_TEXT_TYPES)}")
        # The released checkpoints are multimodal ("qwen3_5", "qwen3_5_moe"): the text model's
        # keys sit under text_config. A text-only export ("..._text") has them at the top level.
        text_type = HYBRID_TEXT_TYPES[model_type]
        nested = text_type != model_type
        if nested:
            text = top.get("text_config", dict)
            f = _Fields(text, path, "text_config.")
            if text.get("model_type", text_type) != text_type:
                raise f.error("model_type", f"is {text['model_type']!r}; expected {text_type!r}")
        else:
            f = top
        _check_activation(f)
        _check_unquantized(top, *([f] if nested else []))
        if f.data.get("attn_output_gate", True) is not True:
            raise f.error("attn_output_gate", "must be true: Qwen3.5 full attention always has an output gate")
        moe = text_type == "qwen3_5_moe_text"
        dims = _layer_dims(f, dense_mlp=not moe)
        return cls(
            dims=dims,
            linear=_linear_dims(f),
            layer_types=_hybrid_layer_types(f, dims.num_hidden_layers),
            partial_rotary_factor=_partial_rotary_factor(f, dims.head_dim),
            vocab_size=f.positive("vocab_size"),
            tie_word_embeddings=f.get("tie_word_embeddings", bool, top.get("tie_word_embeddings", bool, False)),
            # the multimodal config's top-level eos (<|im_end|>) differs from text_config's
            eos_token_ids=_eos_token_ids(f, Path(directory), top if nested else None),
            has_vision=nested and top.data.get("vision_config") is not None,
            model_type=model_type,
            moe=_moe_dims(f, dims.num_hidden_layers, shared=True, always_renormalize=True) if moe else None,
        )


def _linear_dims(f: _Fields) -> LinearAttentionDims:
    # Defaults are transformers' Qwen3_5TextConfig defaults (the Qwen3.5-9B shapes).
    k_heads = f.positive("linear_num_key_heads", 16)
    v_heads = f.positive("linear_num_value_heads", 32)
    if v_heads % k_heads:
        raise f.error("linear_num_value_heads", f"= {v_heads} must be a multiple of linear_num_key_heads = {k_heads}")
    kernel = f.positive("linear_conv_kernel_dim", 4)
    if kernel < 2:
        raise f.error("linear_conv_kernel_dim", f"must be >= 2, got {kernel}")
    return LinearAttentionDims(
        num_key_heads=k_heads,
        num_value_heads=v_heads,
        key_head_dim=f.positive("linear_key_head_dim", 128),
        value_head_dim=f.positive("linear_value_head_dim", 128),
        conv_kernel_size=kernel,
    )


def _hybrid_layer_types(f: _Fields, num_layers: int) -> tuple[str, ...]:
    types = f.data.get("layer_types")
    if types is None:
        # transformers' rule for configs without layer_types: every n-th layer is full attention
        n = f.positive("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise f.error("layer_types", f"must list {num_layers} layer kinds (num_hidden_layers), got {types!r}")
    for kind in types:
        if kind not in HYBRID_LAYER_KINDS:
            raise f.error("layer_types", f"has unknown kind {kind!r}; known: {', '.join(HYBRID_LAYER_KINDS)}")
    return tuple(types)


def _partial_rotary_factor(f: _Fields, head_dim: int) -> float:
    _, params = _rope_params(f)
    factor = f.data.get("partial_rotary_factor", params.get("partial_rotary_factor", 0.25))  # transformers' default
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
        raise f.error("partial_rotary_factor", f"must be a number in (0, 1], got {factor!r}")
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2:
        raise f.error("partial_rotary_factor", f"= {factor} turns {rotary} of head_dim {head_dim} channels; "
                                               "that must be an even number >= 2")
    return float(factor)


def _eos_token_ids(f: _Fields, directory: Path, top: _Fields | None = None) -> tuple[int, ...]:
    """Every eos id the checkpoint names, in order: config.json's, then generation_config.json's."""
    eos = _token_ids(f, "eos_token_id") + (_token_ids(top, "eos_token_id") if top else ())
    gen_path = directory / "generation_config.json"
    if gen_path.exists():
        eos += _token_ids(_Fields(read_json(gen_path), gen_path), "eos_token_id")
    return tuple(dict.fromkeys(eos))  # without repeats


def default_target_layer_ids(num_draft_layers: int, num_target_layers: int) -> tuple[int, ...]:
    """z-lab's default taps: spread between the second and the third-to-last target layer."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    step = (end - start) / (num_draft_layers - 1)
    return tuple(int(round(start + i * step)) for i in range(num_draft_layers))


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """A z-lab DFlash drafter: Qwen3 layers over a block, fed by K target taps."""

    dims: LayerDims
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # 0-based target layers whose *output* is tapped
    layer_types: tuple[str, ...]
    sliding_window: int | None
    vocab_size: int | None

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dir(cls, directory: Path, num_target_layers: int | None = None) -> "DraftConfig":
        """`num_target_layers` feeds the default tap formula when the config lists no taps."""
        path = Path(directory) / "config.json"
        return cls.from_mapping(read_json(path), path, num_target_layers)

    @classmethod
    def from_mapping(cls, data: dict, path: Path, num_target_layers: int | None = None) -> "DraftConfig":
        """A config.json's contents (`path` names it in errors), before or without the file."""
        f = _Fields(data, path)
        dflash = f.data.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise f.error("dflash_config", f"must be an object, got {dflash!r}")
        if f.data.get("model_type", "qwen3") != "qwen3":
            raise f.error("model_type", f"is {f.data['model_type']!r}; DFlash drafters use Qwen3 layers ('qwen3')")
        _check_activation(f)
        dims = _layer_dims(f)
        layer_types = _layer_types(f, dims.num_hidden_layers)
        window = f.positive("sliding_window", None)
        if "sliding_attention" in layer_types and window is None:
            raise f.error("sliding_window", "is required when layer_types has 'sliding_attention'")
        return cls(
            dims=dims,
            block_size=_block_size(f, dflash),
            mask_token_id=_mask_token_id(f, dflash),
            target_layer_ids=_target_layer_ids(f, dflash, dims.num_hidden_layers, num_target_layers),
            layer_types=layer_types,
            sliding_window=window if "sliding_attention" in layer_types else None,
            vocab_size=f.positive("vocab_size", None),
        )


def _block_size(f: _Fields, dflash: dict) -> int:
    top, nested = f.data.get("block_size"), dflash.get("block_size")
    if top is not None and nested is not None and top != nested:
        raise f.error("block_size", f"= {top} disagrees with dflash_config.block_size = {nested}")
    value = top if top is not None else nested
    if value is None:
        raise f.error("block_size", "is missing (expected at top level or in dflash_config)")
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise f.error("block_size", f"must be an int >= 2, got {value!r}")
    return value


def _mask_token_id(f: _Fields, dflash: dict) -> int:
    value = dflash.get("mask_token_id", f.data.get("mask_token_id"))
    if value is None:
        raise f.error("dflash_config.mask_token_id", "is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise f.error("dflash_config.mask_token_id", f"must be a non-negative int, got {value!r}")
    return value


def _target_layer_ids(f: _Fields, dflash: dict, num_layers: int, num_target_layers: int | None) -> tuple[int, ...]:
    ids = dflash.get("target_layer_ids", f.data.get("target_layer_ids"))
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise f.error("dflash_config.target_layer_ids", f"must be a non-empty list of ints >= 0, got {ids!r}")
        return tuple(ids)
    n = dflash.get("num_target_layers", f.data.get("num_target_layers", num_target_layers))
    if not isinstance(n, int) or n < 4:
        raise f.error("num_target_layers", f"must be an int >= 4 when target_layer_ids is absent, got {n!r}")
    return default_target_layer_ids(num_layers, n)


def _layer_types(f: _Fields, num_layers: int) -> tuple[str, ...]:
    types = f.data.get("layer_types")
    if types is None:
        return ("full_attention",) * num_layers
    if not isinstance(types, list) or len(types) != num_layers:
        raise f.error("layer_types", f"must list {num_layers} layer kinds, got {types!r}")
    for kind in types:
        if kind not in LAYER_KINDS:
            raise f.error("layer_types", f"has unknown kind {kind!r}; known: {', '.join(LAYER_KINDS)}")
    return tuple(types)


def check_pair(target: TargetConfig, draft: DraftConfig, draft_dir: Path | str = "drafter") -> None:
    """The pairing rules of a target and a drafter that do not need the weights."""
    path = Path(draft_dir) / "config.json"
    if draft.dims.hidden_size != target.dims.hidden_size:
        raise PairError(
            f"{path}: hidden_size = {draft.dims.hidden_size} differs from the target's hidden_size = "
            f"{target.dims.hidden_size}"
        )
    for tap in draft.target_layer_ids:
        if tap >= target.dims.num_hidden_layers:
            raise PairError(
                f"{path}: target_layer_ids has {tap}, but the target has only "
                f"{target.dims.num_hidden_layers} layers (ids are 0-based)"
            )
    if draft.mask_token_id >= target.vocab_size:
        raise PairError(
            f"{path}: mask_token_id = {draft.mask_token_id} is outside the target's embedding table "
            f"(vocab_size = {target.vocab_size})"
        )


# -- build configs (presets and engine.json) ------------------------------------------------

# The top-level build_configs/ is installed as this package (see pyproject.toml).
PRESET_DIR = Path(str(importlib.resources.files("dflash_trt.build_configs")))
# The engine directory `dflash-trt build` writes: the build's record (this config, resolved)
# and the target's tokenizer files, beside the packed target/ and drafter/ checkpoints.
ENGINE_FILE = "engine.json"
TOKENIZER_DIR = "tokenizer"
DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")


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
    # the drafter attends to the last this many committed tokens only (0: all of them);
    # bounds its cache and its attention time on long contexts (DraftWindowCache)
    draft_window_size: int = 0
    # the drafter proposes only the K tokens most frequent in draft_vocab_corpus (0: all);
    # its LM head reads K rows instead of the vocabulary's (verification is untouched)
    draft_vocab_size: int = 0
    draft_vocab_corpus: str = ""  # a token dataset (train's OUTPUT/data), a JSONL of prompts or a text file
    # prompts enter the caches at most this many tokens per engine step, interleaved with the
    # running requests' steps (0: a prompt in one pass); see engine.py
    prefill_chunk_size: int = 0
    # "full": every verify checks the whole block; "adaptive": per step, the width that
    # maximises expected tokens per second (verify_width.py; needs CUDA graphs); "auto":
    # adaptive where the engine runs CUDA graphs on one rank, else full
    verify_width: str = "auto"
    # the host's work on step n+1 overlaps the device's on step n (engine.py; false: the
    # serial loop, SGLang's --disable-overlap-schedule)
    overlap: bool = True
    tensor_parallel: int = 1  # ranks (GPUs, or CPU processes) the engine is sharded over
    # text_input bytes preprocessing accepts before tokenizing; 0: what max_input_len tokens
    # can be at most (serving.text.max_text_bytes)
    max_input_bytes: int = 0
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
        if not isinstance(self.tensor_parallel, int) or self.tensor_parallel < 1:
            problems.append(f"tensor_parallel must be an int >= 1, got {self.tensor_parallel!r}")
        if not isinstance(self.draft_window_size, int) or self.draft_window_size < 0:
            problems.append(f"draft_window_size must be 0 (none) or an int > 0, got {self.draft_window_size!r}")
        if not isinstance(self.prefill_chunk_size, int) or self.prefill_chunk_size < 0:
            problems.append(f"prefill_chunk_size must be 0 (a prompt in one pass) or an int > 0, got "
                            f"{self.prefill_chunk_size!r}")
        if self.verify_width not in ("full", "adaptive", "auto"):
            problems.append(f"verify_width must be full, adaptive or auto, got {self.verify_width!r}")
        elif self.verify_width == "adaptive" and self.tensor_parallel > 1:
            problems.append("verify_width = adaptive with tensor_parallel > 1 is not supported yet (every rank would "
                            "have to choose the same width)")
        if not isinstance(self.draft_vocab_size, int) or self.draft_vocab_size < 0:
            problems.append(f"draft_vocab_size must be 0 (all) or an int > 0, got {self.draft_vocab_size!r}")
        if bool(self.draft_vocab_size) != bool(self.draft_vocab_corpus):
            problems.append("draft_vocab_size and draft_vocab_corpus go together (the corpus picks the tokens)")
        if not isinstance(self.max_input_bytes, int) or self.max_input_bytes < 0:
            problems.append(f"max_input_bytes must be 0 (derived) or an int > 0, got {self.max_input_bytes!r}")
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

    @classmethod
    def from_mapping(cls, data: dict, source: str) -> "BuildConfig":
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(known)}")
        for key, value in data.items():
            expected = {"int": int, "bool": bool}.get(known[key], str)
            if not isinstance(value, expected) or (isinstance(value, bool) and expected is not bool):
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


def read_engine_record(engine_dir: Path) -> tuple[dict, BuildConfig]:
    """engine.json of a built engine directory and its build config, read here only (torch-free,
    so the preprocessing model reads its limits without loading the engine)."""
    engine_dir = Path(engine_dir)
    path = engine_dir / ENGINE_FILE
    try:
        record = json.loads(path.read_text())
        config = BuildConfig.from_mapping(record["build_config"], str(path))
    except FileNotFoundError:
        raise BuildError(f"{path}: not found; is {engine_dir} an engine directory from `dflash-trt build`?") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise BuildError(f"{path}: not a valid engine record ({e!r})") from None
    return record, config
