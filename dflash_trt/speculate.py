"""One DFlash step for a batch: draft -> verify -> accept -> commit.

The acceptance rules are pure functions so they can be tested on toy tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dflash_trt.kv_cache import Batch, KVCache
from dflash_trt.sampling import sample, target_probs
from dflash_trt.sequence import Sequence


def accepted_length(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Greedy rule: how many leading drafts equal the target's own choice.

    draft [bs, γ] holds d_1..d_γ; target [bs, γ] holds t_0..t_{γ-1}, the target's argmax
    at the positions the drafts fill (t_{j-1} is compared with d_j).
    """
    return (draft == target).long().cumprod(dim=-1).sum(dim=-1)


def speculative_sample(probs: torch.Tensor, draft: torch.Tensor, generator) -> tuple[int, int]:
    """Lossless rule for a point-mass draft: probs [B, V] target distributions, draft [B-1].

    Draft d_j is accepted with probability p_{j-1}(d_j); on the first rejection the bonus is
    drawn from p_{j-1} with d_j removed and renormalised, so every emitted token is
    distributed exactly as the target would sample it. Returns (accepted drafts, bonus).
    """
    for j, token in enumerate(draft.tolist()):
        p = probs[j]
        if torch.rand((), generator=generator, device=p.device) < p[token]:
            continue
        residual = p.clone()
        residual[token] = 0
        return j, sample(residual / residual.sum(), generator)
    return len(draft), sample(probs[-1], generator)


def accept(logits: torch.Tensor, draft: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
    """logits [bs, B, V] (row j predicts position start+j+1), draft [bs, B-1] -> (accepted, bonus)."""
    choice = logits.argmax(dim=-1)
    accepted = accepted_length(draft, choice[:, :-1])
    bonus = choice.gather(1, accepted[:, None])[:, 0]
    accepted, bonus = accepted.tolist(), bonus.tolist()  # the step's one host sync
    for i, seq in enumerate(seqs):
        if not seq.params.greedy:
            accepted[i], bonus[i] = speculative_sample(target_probs(logits[i], seq.params), draft[i], seq.generator)
    return accepted, bonus


class OracleDrafts:
    """Acceptance driven from outside: the oracle mode of benchmarks, and tests.

    The drafter still runs at full cost; then the first k drafts of each row are replaced
    by the request's known target continuation (`references`, keyed by prompt), with k
    drawn by `num_correct(seq)`. Greedy verification must still reproduce the target's
    own output, so the rows past k exercise rejection and the rows up to k acceptance.
    """

    def __init__(self, references: dict[tuple[int, ...], list[int]], num_correct: Callable[[Sequence], int]):
        self.references, self.num_correct = references, num_correct

    def apply(self, seqs: list[Sequence], drafts: torch.Tensor) -> None:
        """drafts [bs, B-1], edited in place; draft j of a row fills output index len(output)-1+j."""
        for row, seq in enumerate(seqs):
            known = self.references.get(tuple(seq.prompt_ids), [])[len(seq.output_ids):]
            k = min(self.num_correct(seq), drafts.shape[1], len(known))
            if k:
                drafts[row, :k] = torch.tensor(known[:k], device=drafts.device)


@dataclass(frozen=True)
class StepOutput:
    tokens: list[list[int]]  # per row: the accepted drafts, then the bonus token
    accepted: list[int]  # drafts accepted per row (the acceptance length is this + 1)


def speculative_step(target, drafter, target_cache: KVCache, draft_cache: KVCache,
                     seqs: list[Sequence], taps: tuple[int, ...], oracle: OracleDrafts | None = None) -> StepOutput:
    B = drafter.config.block_size
    device = target_cache.k.device
    batch = Batch.make([s.slot for s in seqs], [s.num_cached for s in seqs], [B] * len(seqs), B, device)

    # draft: one drafter pass over [bonus, MASK x (B-1)] proposes B-1 tokens at once
    block = torch.full((len(seqs), B), drafter.config.mask_token_id, dtype=torch.long, device=device)
    block[:, 0] = torch.tensor([s.last_token for s in seqs], device=device)
    hidden = drafter(block, batch, draft_cache)
    block[:, 1:] = drafter.logits(hidden[:, 1:]).argmax(dim=-1)
    if oracle is not None:
        oracle.apply(seqs, block[:, 1:])

    # verify: one causal target pass over the block writes its K/V at start..start+B-1
    hidden, tapped = target(block, batch, target_cache, taps)
    logits = target.logits(hidden)

    # accept
    accepted, bonus = accept(logits, block[:, 1:], seqs)

    # commit: the drafter caches the committed rows' context K/V; the target keeps its
    # rows by length (the engine advances num_cached; rejected rows get overwritten), and
    # a target with recurrent state restores that state to the committed prefix
    committed = [a + 1 for a in accepted]
    max_end = max(s.num_cached + c for s, c in zip(seqs, committed))
    kept = batch.with_num_tokens(torch.tensor(committed, device=device), max_end)
    target.commit(target_cache, batch, kept.num_tokens)
    drafter.append_context(tapped, kept, draft_cache)
    drafts = block[:, 1:].tolist()
    return StepOutput([drafts[i][:a] + [bonus[i]] for i, a in enumerate(accepted)], accepted)
