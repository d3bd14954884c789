"""The drafter matches a naive reference written straight from the DFlash math: no cache,
no batching, explicit loops over heads and queries."""

import math

import pytest
import torch
from safetensors.torch import load_file

from dflash_trt.kv_cache import Batch
from dflash_trt.loading import load_pair

ATOL = 1e-4


def rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    """x [n, heads, d] at positions pos [n], neox halves."""
    d = x.shape[-1]
    inv = torch.tensor([1.0 / theta ** (2 * i / d) for i in range(d // 2)])
    ang = pos[:, None].float() * inv  # [n, d/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def naive_block_logits(w, cfg, feats, block_ids, embed, lm_head, window=None):
    """feats [s, K*H] for positions 0..s-1; block_ids [B] at positions s..s+B-1 -> logits [B-1, V].
    `window`: the draft window, context positions below s - window are invisible."""
    s, B = feats.shape[0], len(block_ids)
    nh, nkv, d, theta = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rope_theta"]
    ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = embed[block_ids]
    ctx_pos, blk_pos = torch.arange(s), torch.arange(s, s + B)
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        proj = lambda t, name, heads: (t @ w[p + f"self_attn.{name}.weight"].T).reshape(len(t), heads, d)  # noqa: E731
        q = rope(rms(proj(h, "q_proj", nh), w[p + "self_attn.q_norm.weight"]), blk_pos, theta)
        keys = torch.cat([
            rope(rms(proj(ctx, "k_proj", nkv), w[p + "self_attn.k_norm.weight"]), ctx_pos, theta),
            rope(rms(proj(h, "k_proj", nkv), w[p + "self_attn.k_norm.weight"]), blk_pos, theta),
        ])
        values = torch.cat([proj(ctx, "v_proj", nkv), proj(h, "v_proj", nkv)])
        key_pos = torch.cat([ctx_pos, blk_pos])
        out = torch.zeros(B, nh, d)
        for head in range(nh):
            kv_head = head // (nh // nkv)
            for j in range(B):
                qpos = s + j
                allowed = [
                    (kind == "full_attention" or (kp <= qpos and kp > qpos - cfg["sliding_window"]))
                    and (window is None or kp >= s - window)
                    for kp in key_pos.tolist()
                ]
                idx = torch.tensor([n for n, ok in enumerate(allowed) if ok])
                scores = keys[idx, kv_head] @ q[j, head] / math.sqrt(d)
                out[j, head] = scores.softmax(0) @ values[idx, kv_head]
        x = x + out.reshape(B, nh * d) @ w[p + "self_attn.o_proj.weight"].T
        g = rms(x, w[p + "post_attention_layernorm.weight"])
        mlp = torch.nn.functional.silu(g @ w[p + "mlp.gate_proj.weight"].T) * (g @ w[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"])[1:] @ lm_head.T


DRAFTERS = {
    "full": dict(draft_layers=2, target_layer_ids=(0, 2)),
    "sliding+full": dict(draft_layers=3, target_layer_ids=(1, 2), sliding_window=3,
                         draft_layer_types=("sliding_attention", "full_attention", "sliding_attention")),
    "prefixed-3taps-1layer": dict(draft_layers=1, target_layer_ids=(0, 1, 3), draft_prefix="model.",
                                  draft_rope_theta=10000.0, stray_embeddings=True),
}


@pytest.mark.parametrize("name", DRAFTERS)
def test_drafter_block_logits_match_naive_reference(make_pair, no_tokenizer, name):
    pair = make_pair(**DRAFTERS[name], block_size=6, **no_tokenizer)
    engine = load_pair(pair.target, pair.drafter)
    drafter, target = engine.drafter, engine.target
    cfg = __import__("json").loads((pair.drafter / "config.json").read_text())
    w = {k.removeprefix("model."): v for k, v in load_file(pair.drafter / "model.safetensors").items()}
    K, H = drafter.config.num_taps, drafter.config.dims.hidden_size
    gen = torch.Generator().manual_seed(0)
    # three requests with ragged context lengths, one of them empty
    lengths, slots = [7, 0, 2], [1, 2, 0]
    feats = [torch.randn(n, K * H, generator=gen) for n in lengths]
    blocks = torch.randint(0, 500, (3, 6), generator=gen)
    cache = drafter.new_cache(3, 16)
    width = max(lengths)
    padded = torch.stack([torch.cat([f, torch.zeros(width - len(f), K * H)]) for f in feats])
    with torch.no_grad():
        # context arrives in two pieces, as it does across prefill and verify rounds
        first = [min(n, 3) for n in lengths]
        drafter.append_context(padded, Batch.make(slots, [0] * 3, first, width, "cpu"), cache)
        rest = torch.stack([torch.cat([f[m:], torch.zeros(width - len(f) + m, K * H)]) for f, m in zip(feats, first)])
        drafter.append_context(rest, Batch.make(slots, first, [n - m for n, m in zip(lengths, first)], width, "cpu"),
                               cache)
        hidden = drafter(blocks, Batch.make(slots, lengths, [6] * 3, 6, "cpu"), cache)
        logits = drafter.logits(hidden[:, 1:])
        for row in range(3):
            expected = naive_block_logits(w, cfg, feats[row], blocks[row], target.model.embed_tokens.weight,
                                          target.lm_head.weight)
            assert (logits[row] - expected).abs().max() <= ATOL, row


def test_drafter_borrows_target_embedding_and_lm_head(make_pair, no_tokenizer):
    pair = make_pair(**DRAFTERS["prefixed-3taps-1layer"], block_size=6, **no_tokenizer)
    engine = load_pair(pair.target, pair.drafter)
    assert engine.drafter.embed_tokens is engine.target.model.embed_tokens
    assert engine.drafter.lm_head is engine.target.lm_head
    assert not any("embed" in k or "lm_head" in k for k in engine.drafter.state_dict())


@pytest.mark.parametrize("name", ["full", "sliding+full"])
def test_drafter_with_a_draft_window_sees_only_the_last_w_committed_rows(make_pair, no_tokenizer, device, name):
    """Prefill (a prompt longer than the ring, one shorter than the window, an empty one),
    then verify rounds that write whole blocks and commit only some rows: after each, the
    block logits match the reference that sees context positions [s - W, s) only."""
    B, W = 6, 7
    pair = make_pair(**DRAFTERS[name], block_size=B, **no_tokenizer)
    engine = load_pair(pair.target, pair.drafter, device=device)
    drafter, target = engine.drafter, engine.target
    cfg = __import__("json").loads((pair.drafter / "config.json").read_text())
    w = {k.removeprefix("model."): v for k, v in load_file(pair.drafter / "model.safetensors").items()}
    K, H = drafter.config.num_taps, drafter.config.dims.hidden_size
    gen = torch.Generator().manual_seed(1)
    slots, lengths = [2, 0, 1], [W + B + 4, 3, 0]  # the ring holds W + B - 1 rows
    cache = drafter.new_cache(4, 0, window=W, block_size=B)  # slot 3: the scratch slot
    committed = [torch.randn(n, K * H, generator=gen) for n in lengths]
    width = max(lengths)
    padded = torch.stack([torch.cat([f, torch.randn(width - len(f), K * H, generator=gen)]) for f in committed])
    embed, lm_head = target.model.embed_tokens.weight.cpu(), target.lm_head.weight.cpu()
    with torch.no_grad():
        drafter.append_context(padded.to(device), Batch.make(slots, [0] * 3, lengths, width, device), cache)
        for round_ in range(5):
            start = [len(f) for f in committed]
            blocks = torch.randint(0, 500, (3, B), generator=gen)
            hidden = drafter(blocks.to(device), Batch.make(slots, start, [B] * 3, B, device), cache)
            logits = drafter.logits(hidden[:, 1:]).cpu()
            for row in range(3):
                expected = naive_block_logits(w, cfg, committed[row], blocks[row], embed, lm_head, window=W)
                assert (logits[row] - expected).abs().max() <= ATOL, (round_, row)
            # verify: all B rows' context is written, then 1..B of them are kept
            written = torch.randn(3, B, K * H, generator=gen)
            drafter.append_context(written.to(device), Batch.make(slots, start, [B] * 3, B, device), cache)
            kept = torch.randint(1, B + 1, (3,), generator=gen).tolist()
            committed = [torch.cat([f, written[i, :k]]) for i, (f, k) in enumerate(zip(committed, kept))]
    assert cache.k.shape[2] == 2 * (W + B - 1)  # memory by the window, not by the context
