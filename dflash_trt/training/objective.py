"""The DFlash training objective (docs: ../shared/reference/dflash-spec.md section 6).

A batch of target-written sequences becomes N blocks per sequence at random anchors: block b
is [token at anchor a_b, MASK x (B-1)] at positions a_b .. a_b + B - 1, and its slot j learns
the token at a_b + j. As at inference, a block sees the target's tapped features of the
positions before its anchor (not the anchor's own: the engine has not run the target there
yet) and its own B rows, nothing of other blocks; a sliding-window layer sees its own rows
causally and the context within its window. Slot j's loss weighs exp(-(j - 1) / gamma): the
early slots decide how much of a block is accepted.

A block may be shorter than the drafter's B (`draw_lengths`): its L rows see only each other, as
at inference with block size L, where the drafter runs L rows. The rows are bidirectional, so a
drafter trained only at B drafts worse at a smaller block; trained at both, it serves both.

`DraftObjective` is the drafter's forward written for autograd (plain PyTorch on the drafter's
own parameters; the inference forward writes caches and runs fused kernels without gradients).
The equivalence of the two is tested (tests/test_train.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.models.dflash import DFlashDrafter
from dflash_trt.models.layers import apply_rope

IGNORE = -100


def default_decay(block_size: int) -> float:
    """gamma of the slot weights: 7 at block 16, 5 at 10, 4 at 8 (the paper's), between by line."""
    return max(1.0, 4 + (block_size - 8) * 3 / 8)


@dataclass(frozen=True)
class Blocks:
    """N blocks per sequence: anchors [bs, N] (0 where unused), which are used [bs, N] and, where
    blocks differ in size, each one's rows [bs, N] (None: every block has the drafter's B)."""

    anchors: torch.Tensor
    valid: torch.Tensor
    lengths: torch.Tensor | None = None

    def rows_used(self, block_size: int) -> torch.Tensor:
        """[bs, N, B] bool: the rows each block has (all B unless it is shorter)."""
        if self.lengths is None:
            return torch.ones(*self.anchors.shape, block_size, dtype=torch.bool, device=self.anchors.device)
        return torch.arange(block_size, device=self.anchors.device) < self.lengths[:, :, None]


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> Blocks:
    """Up to `num_anchors` distinct anchors per sequence, uniformly among the positions p where
    p and p + 1 are both supervised (response tokens: at inference a block starts at a token the
    target produced), sorted. loss_mask [bs, S] bool."""
    candidates = torch.zeros_like(loss_mask)
    candidates[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    # random keys, candidates first: the top num_anchors keys are a uniform draw among them
    keys = torch.rand(loss_mask.shape, generator=generator).to(loss_mask.device) + candidates.float()
    n = min(num_anchors, loss_mask.shape[1])
    top = keys.topk(n, dim=1).indices
    valid = candidates.gather(1, top)
    anchors = torch.where(valid, top, torch.full_like(top, loss_mask.shape[1]))  # unused ones sort last
    anchors, order = anchors.sort(dim=1)
    valid = valid.gather(1, order)
    return Blocks(anchors=torch.where(valid, anchors, torch.zeros_like(anchors)), valid=valid)


def draw_lengths(blocks: Blocks, sizes: tuple[int, ...], generator: torch.Generator) -> Blocks:
    """Each block's size drawn uniformly among `sizes` (each at most the drafter's B)."""
    pick = torch.randint(len(sizes), blocks.anchors.shape, generator=generator)
    lengths = torch.tensor(sizes)[pick].to(blocks.anchors.device)
    return Blocks(anchors=blocks.anchors, valid=blocks.valid, lengths=lengths)


def block_inputs(ids: torch.Tensor, loss_mask: torch.Tensor, blocks: Blocks, block_size: int, mask_token_id: int):
    """-> block ids [bs, N*B], their positions [bs, N*B], labels [bs, N*B] (IGNORE where slot 0,
    unused blocks, rows a shorter block lacks, past the sequence or unsupervised)."""
    bs, S = ids.shape
    j = torch.arange(block_size, device=ids.device)
    positions = blocks.anchors[:, :, None] + j  # [bs, N, B]
    inside = positions < S
    at = positions.clamp(max=S - 1)
    labels = ids.gather(1, at.flatten(1)).view_as(at)
    supervised = inside & loss_mask.gather(1, at.flatten(1)).view_as(at) & blocks.valid[:, :, None] & (j > 0)
    supervised = supervised & blocks.rows_used(block_size)
    labels = torch.where(supervised, labels, torch.full_like(labels, IGNORE))
    block_ids = torch.full_like(labels, mask_token_id)
    block_ids[:, :, 0] = ids.gather(1, blocks.anchors)
    return block_ids.flatten(1), positions.flatten(1), labels.flatten(1)


def attention_mask(blocks: Blocks, context_len: int, block_size: int, window: int | None = None) -> torch.Tensor:
    """Which keys each block row sees -> bool [bs, 1, N*B, S + N*B]; keys are the S context
    rows, then every block's rows. An unused block sees only itself (no row is left without a
    key; it carries no loss); no row sees the rows a shorter block lacks (they carry no loss)."""
    bs, N = blocks.anchors.shape
    device = blocks.anchors.device
    j = torch.arange(block_size, device=device)
    q_pos = (blocks.anchors[:, :, None] + j).flatten(1)  # [bs, N*B]
    q_anchor = blocks.anchors.repeat_interleave(block_size, dim=1)
    ctx = torch.arange(context_len, device=device)
    sees_ctx = (ctx < q_anchor[:, :, None]) & blocks.valid.repeat_interleave(block_size, dim=1)[:, :, None]
    q_block = torch.arange(N, device=device).repeat_interleave(block_size)
    sees_block = (q_block[:, None] == q_block[None, :]) & blocks.rows_used(block_size).flatten(1)[:, None, :]
    if window is not None:
        sees_ctx = sees_ctx & (ctx > q_pos[:, :, None] - window)
        q_slot = j.repeat(N)
        ahead = q_slot[:, None] - q_slot[None, :]  # [query, key]: how far the key is behind
        sees_block = sees_block & (ahead >= 0) & (ahead < window)
    return torch.cat([sees_ctx, sees_block], dim=2)[:, None]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)


class DraftObjective(nn.Module):
    """The drafter's block logits and weighted loss for a batch, differentiable in the
    drafter's own parameters (DDP wraps this module)."""

    def __init__(self, drafter: DFlashDrafter, decay: float | None = None):
        super().__init__()
        self.drafter = drafter
        self.decay = decay or default_decay(drafter.config.block_size)

    def hidden(self, taps: torch.Tensor, block_ids: torch.Tensor, positions: torch.Tensor,
               masks: dict[int | None, torch.Tensor]) -> torch.Tensor:
        """taps [bs, S, K*H] of context positions 0..S-1 -> final hidden of the block rows."""
        dr = self.drafter
        d = dr.config.dims
        bs, S = taps.shape[:2]
        ctx = _rms_norm(F.linear(taps.to(dr.fc.weight.dtype), dr.fc.weight), dr.hidden_norm.weight, d.rms_norm_eps)
        ctx_pos = torch.arange(S, device=taps.device).expand(bs, -1)
        cos_c, sin_c = dr.rotary(ctx_pos, torch.float32)
        cos_b, sin_b = dr.rotary(positions, torch.float32)
        x = dr.embed_tokens(block_ids).float()
        for layer in dr.layers:
            attn = layer.self_attn
            h = _rms_norm(x, layer.input_layernorm.weight, d.rms_norm_eps)
            w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
            q, k, v = F.linear(h, w, b).split([d.q_size, d.kv_size, d.kv_size], dim=-1)
            kc, vc = F.linear(ctx, w[d.q_size:], None if b is None else b[d.q_size:]).split(d.kv_size, dim=-1)
            heads = lambda t, n: t.unflatten(-1, (n, d.head_dim))  # noqa: E731
            q = apply_rope(_rms_norm(heads(q, d.num_attention_heads), attn.q_norm.weight, d.rms_norm_eps), cos_b, sin_b)
            k = torch.cat([apply_rope(_rms_norm(heads(kc, d.num_key_value_heads), attn.k_norm.weight, d.rms_norm_eps),
                                      cos_c, sin_c),
                           apply_rope(_rms_norm(heads(k, d.num_key_value_heads), attn.k_norm.weight, d.rms_norm_eps),
                                      cos_b, sin_b)], dim=1)
            v = torch.cat([heads(vc, d.num_key_value_heads), heads(v, d.num_key_value_heads)], dim=1)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).to(q.dtype),
                                                 v.transpose(1, 2).to(q.dtype), attn_mask=masks[attn.window],
                                                 scale=attn.scale, enable_gqa=True)
            x = x + F.linear(out.transpose(1, 2).flatten(2).to(h.dtype), attn.o_proj.weight).float()
            h = _rms_norm(x, layer.post_attention_layernorm.weight, d.rms_norm_eps)
            gate, up = F.linear(h, layer.mlp.gate_up_proj.weight).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight).float()
        return _rms_norm(x, dr.norm.weight, d.rms_norm_eps)

    def forward(self, ids: torch.Tensor, loss_mask: torch.Tensor, taps: torch.Tensor, blocks: Blocks,
                target_hidden: torch.Tensor | None = None):
        """-> (loss, per-slot cross-entropy sums [B], per-slot label counts [B]) over the batch. The
        loss is each row's cross-entropy of the target's token; given the target's final hidden
        states [bs, S, H], it is instead each row's distillation loss (distillation())."""
        cfg = self.drafter.config
        B = cfg.block_size
        block_ids, positions, labels = block_inputs(ids, loss_mask, blocks, B, cfg.mask_token_id)
        windows = {layer.self_attn.window for layer in self.drafter.layers}
        masks = {w: attention_mask(blocks, ids.shape[1], B, w) for w in windows}
        hidden = self.hidden(taps, block_ids, positions, masks)
        rows = labels.flatten() != IGNORE
        slot = torch.arange(labels.shape[1], device=ids.device).remainder(B).expand_as(labels).flatten()[rows]
        weight = torch.exp(-(slot - 1).clamp(min=0).float() / self.decay)
        logits = F.linear(hidden.flatten(0, 1)[rows].to(self.drafter.lm_head.weight.dtype),
                          self.drafter.lm_head.weight).float()
        ce = F.cross_entropy(logits, labels.flatten()[rows], reduction="none")
        loss = ce if target_hidden is None else self.distillation(logits, target_hidden, positions, rows)
        total = (loss * weight).sum() / weight.sum().clamp(min=1e-6)
        per_slot = torch.zeros(B, device=ids.device).index_add_(0, slot, ce.detach())
        counts = torch.zeros(B, device=ids.device).index_add_(0, slot, torch.ones_like(ce))
        return total, per_slot, counts

    def distillation(self, logits: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor,
                     rows: torch.Tensor) -> torch.Tensor:
        """KL(target || drafter) of each supervised row's next-token distributions [rows]. The
        target's for the token at position p is its LM head (the drafter's, shared) at its row
        p - 1, before the token: the whole distribution, not only its greedy pick, a fuller signal
        where the target hesitates, which is where a small drafter errs most
        (benchmarks/demo_ceiling.json, the drafter's right_by_target_top1)."""
        lm_head = self.drafter.lm_head.weight
        row_of = torch.arange(positions.shape[0], device=positions.device)[:, None].expand_as(positions)
        before = target_hidden[row_of.flatten()[rows], positions.flatten()[rows] - 1]  # p > anchor >= 0
        with torch.no_grad():
            target_logp = F.log_softmax(F.linear(before.to(lm_head.dtype), lm_head).float(), dim=-1)
        return F.kl_div(F.log_softmax(logits, dim=-1), target_logp, log_target=True, reduction="none").sum(-1)

