"""The `transformers` baseline of `dflash-trt bench --compare-transformers`.

`to_transformers` turns our loaded target into a `transformers.Qwen3ForCausalLM` on the same
device and dtype that *shares* the target's weights: a fused `qkv_proj` / `gate_up_proj`
(PackedLinear) stacks its checkpoint projections by rows, so each projection is a contiguous
row slice of the fused weight and is handed over as a view; nothing is copied. The model is
built on the meta device first, so no second set of weights is ever allocated.

`generate_tok_s` is the plain `model.generate` recipe: greedy, static KV cache, one prompt at
a time (batch 1). On CUDA transformers compiles the decode step of a static-cache generate
by itself; the static cache is sized once for the longest prompt (`max_cache_len`) so later
prompts reuse the compiled graph. Warm up before timing (bench.py does).

Numerics: our target keeps the residual stream in fp32 (models/qwen3.py), transformers keeps
it in the model dtype, so greedy outputs are identical in fp32 and may part ways in bf16.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from dflash_trt.errors import ConfigError
from dflash_trt.models.layers import PackedLinear


def _shared_state_dict(target) -> dict[str, torch.Tensor]:
    """HF parameter names -> our tensors (PackedLinear weights split into row views)."""
    state = {}
    for module_name, module in target.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            if isinstance(module, PackedLinear):
                parent = module_name.rpartition(".")[0]
                for shard, view in zip(module.shards, param.detach().split(list(module.shards.values()))):
                    state[f"{parent}.{shard}.{leaf}"] = view
            else:
                state[f"{module_name}.{leaf}"] = param.detach()
    return state


def to_transformers(target, attn_implementation: str = "sdpa"):
    """A transformers Qwen3ForCausalLM sharing `target`'s weights (same device and dtype)."""
    # transformers is optional (the test extra): only --compare-transformers needs it
    import transformers
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg, d = target.config, target.config.dims
    if cfg.model_type != "qwen3":
        raise ConfigError(f"the transformers baseline covers Qwen3 targets only, not model_type {cfg.model_type!r}")
    rope = {"rope_type": "default", "rope_theta": d.rope_theta}
    if d.rope_yarn is not None:
        rope = {**rope, "rope_type": "yarn", **dataclasses.asdict(d.rope_yarn)}
    if d.attention_bias:  # transformers' Qwen3 then also expects an o_proj bias, which ours has not
        raise ConfigError("no transformers baseline for a target with attention_bias = true")
    weight = target.lm_head.weight
    config = transformers.Qwen3Config(
        vocab_size=cfg.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_hidden_layers=d.num_hidden_layers, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim, rms_norm_eps=d.rms_norm_eps,
        rope_parameters=rope, attention_bias=False,
        max_position_embeddings=d.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
        eos_token_id=None, pad_token_id=None,  # generate_tok_s says when to stop
    )
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM._from_config(config, dtype=weight.dtype,
                                                           attn_implementation=attn_implementation)
    model.load_state_dict(_shared_state_dict(target), strict=True, assign=True)
    with torch.device(weight.device):  # the RoPE buffers are not weights: compute them on the device
        model.model.rotary_emb = Qwen3RotaryEmbedding(config)
    return model.eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate_tok_s(model, prompt_ids: Sequence[Sequence[int]], max_tokens: int, *, eos_token_ids: Sequence[int] = (),
                   max_cache_len: int | None = None) -> tuple[list[list[int]], float]:
    """Greedy static-cache `model.generate`, batch 1 per prompt: (output ids per prompt, tok/s).

    Outputs stop after an eos_token_ids token (kept, as the engine keeps its stop token) or
    at max_tokens; with no eos_token_ids every output has max_tokens tokens (ignore_eos)."""
    import transformers  # optional (the test extra)

    if not prompt_ids:
        raise ConfigError("no prompts to generate from")
    eos = [int(t) for t in eos_token_ids]
    config = transformers.GenerationConfig(
        max_new_tokens=max_tokens, do_sample=False, cache_implementation="static",
        max_cache_len=max_cache_len or max(len(ids) for ids in prompt_ids) + max_tokens,
        eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
    )
    device = model.device
    outputs = []
    _sync(device)
    start = time.perf_counter()
    for ids in prompt_ids:
        input_ids = torch.tensor([list(ids)], device=device)
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
        outputs.append(out[0, len(ids):].tolist())
    _sync(device)
    elapsed = time.perf_counter() - start
    return outputs, sum(map(len, outputs)) / elapsed if elapsed > 0 else 0.0
