"""One DFlash step for a batch: draft -> verify -> accept -> commit.

The acceptance rules are pure functions so they can be tested on toy tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from dflash_trt import ops
from dflash_trt.sampling import Distribution, draw_keys, row_index, sampled_groups
from dflash_trt.sequence import Sequence

if TYPE_CHECKING:
    from dflash_trt.graphs import StepInputs

# A bound on the scratch of a verify's sampled rows: the lossless rule's fp32 tensors of a
# chunk of rows hold this many [rows, width, vocab] elements
RULE_ELEMENTS = 1 << 24


def accepted_length(draft: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Greedy rule: how many leading drafts equal the target's own choice.

    draft [bs, γ] holds d_1..d_γ; target [bs, γ] holds t_0..t_{γ-1}, the target's argmax
    at the positions the drafts fill (t_{j-1} is compared with d_j).
    """
    return (draft == target).long().cumprod(dim=-1).sum(dim=-1)


def speculative_sample(dist: Distribution, drafts: torch.Tensor,
                       keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rule for point-mass drafts, every row at once: `dist` the target distributions
    p_0..p_{W-1} of each row's block positions (sampling.Distribution, [n, W, V]), drafts
    [n, W-1], keys [n, 2] each row's keys of the acceptance uniforms and of the bonus noise
    (sampling.draw_keys).

    Draft d_j is accepted with probability p_{j-1}(d_j) (d_j sits at index j - 1 of drafts);
    on the first rejection the bonus is drawn from p_{j-1} with d_j removed and renormalised,
    so every emitted token is distributed exactly as the target would sample it; past the
    last draft, from p_{W-1}. The bonus's position is picked on the device, so only that
    position's noise is drawn. Returns (accepted drafts [n], bonus [n]) on the device.
    """
    uniforms = ops.random_uniform(keys[:, 0].contiguous(), drafts.shape[1])
    accepted = (uniforms < dist.probs_of(drafts)).long().cumprod(dim=-1).sum(dim=-1)
    # the draft rejected at the bonus's position; none (-1) after the last draft
    rejected = torch.cat([drafts, drafts.new_full((len(drafts), 1), -1)], dim=1).gather(1, accepted[:, None])
    bonus = dist.at(accepted).draw(keys[:, 1], exclude=rejected)[:, 0]
    return accepted, bonus


class OracleDrafts:
    """Acceptance driven from outside: the oracle mode of benchmarks, and tests.

    The drafter still runs at full cost; then the first k drafts of each row are replaced
    by the request's known target continuation (`references`, keyed by prompt), with k
    drawn by `num_correct(seq)`. Greedy verification must still reproduce the target's
    own output, so the rows past k exercise rejection and the rows up to k acceptance.

    `forced=True` (benchmarks on random weights): a bf16 verify of a random model flips
    near-ties, after which the reference no longer continues the sequence and acceptance
    collapses. Forced, a greedy row accepts exactly its k drafts and takes the reference's
    next token as the bonus, so the sequence follows the reference and τ is the one asked
    for. Both passes still run in full, so a step costs what a real one does; what is given
    up is the check that verify agrees (the lossless tests make it).
    """

    def __init__(self, references: dict[tuple[int, ...], list[int]], num_correct: Callable[[Sequence], int],
                 forced: bool = False):
        self.references, self.num_correct, self.forced = references, num_correct, forced

    def apply(self, seqs: list[Sequence], drafts: torch.Tensor) -> list[tuple[int, list[int]]]:
        """drafts [bs, B-1], edited in place (one copy to the device); draft j of a row fills
        output index len(output)-1+j. Returns per row (k, the reference from there on)."""
        values = torch.zeros(drafts.shape, dtype=drafts.dtype)
        replace = torch.zeros(drafts.shape, dtype=torch.bool)
        plans = []
        for row, seq in enumerate(seqs):
            known = self.references.get(tuple(seq.prompt_ids), [])[len(seq.output_ids):]
            # At the reference's end, k leaves its last token for the bonus, so a forced row
            # emits the reference exactly, stop token included, and ends with it.
            k = min(self.num_correct(seq), drafts.shape[1], len(known) - (1 if self.forced else 0))
            k = max(k, 0)
            values[row, :k] = torch.tensor(known[:k], dtype=drafts.dtype)
            replace[row, :k] = True
            plans.append((k, known[: drafts.shape[1] + 1]))
        dev = drafts.device
        drafts.copy_(torch.where(replace.to(dev, non_blocking=True), values.to(dev, non_blocking=True), drafts))
        return plans

    def settle(self, seqs: list[Sequence], plans, accepted: torch.Tensor, bonus: torch.Tensor,
               width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forced mode: greedy rows take the planned outcome, cut to the drafts a verify of
        `width` tokens could accept. On the device (accepted, bonus [bs] -> new tensors), so
        the outcome can feed the next draft before the host reads it."""
        if not self.forced:
            return accepted, bonus
        force, k_forced, bonus_forced = [], [], []
        for seq, (k, known) in zip(seqs, plans):
            k = min(k, width - 1)
            force.append(seq.params.greedy and k < len(known))
            k_forced.append(k)
            bonus_forced.append(known[k] if k < len(known) else 0)
        dev = accepted.device
        force = torch.tensor(force).to(dev, non_blocking=True)
        return (torch.where(force, torch.tensor(k_forced).to(dev, non_blocking=True), accepted),
                torch.where(force, torch.tensor(bonus_forced).to(dev, non_blocking=True), bonus))


@dataclass(frozen=True)
class Drafted:
    """A draft pass launched for these rows: the inputs it ran on, its block [bs, B] and the
    verify width it proposed for (drafts 1 .. width-1)."""

    seqs: list[Sequence]
    inputs: StepInputs
    block: torch.Tensor
    width: int


@dataclass(frozen=True)
class StepOutput:
    tokens: list[list[int]]  # per row: the accepted drafts, then the bonus token
    accepted: list[int]  # drafts accepted per row (the acceptance length is this + 1)
    next_draft: Drafted | None = None  # the next step's draft, launched before this step was read


def speculative_step(passes, seqs: list[Sequence], oracle: OracleDrafts | None = None, width: int | None = None,
                     drafted: Drafted | None = None, draft_ahead: bool = False,
                     next_width: int | None = None) -> StepOutput:
    """draft -> verify -> accept -> commit for the running sequences (`passes`: graphs.DecodePasses).

    `width` (default: the block): how many tokens of the block the target verifies, the
    bonus token and width - 1 drafts, which are all the draft proposes. Fewer drafts can
    only be accepted less far, and every acceptance rule still holds, so any width is
    lossless (verify_width.py chooses it).

    `drafted`: these rows' draft, launched by the previous step for `width`. `draft_ahead`:
    commit and launch the next step's draft, for `next_width` (default: this width), from the
    verify's outcome on the device (sampled rows' included) before reading it, so the host's
    reading, emitting and next launches overlap the draft pass instead of leaving the device
    idle; the caller drops that draft if its rows change."""
    width = width or passes.block_size

    # draft (or the one the previous step launched)
    if drafted is None:
        inputs = passes.inputs(seqs)
        drafted = Drafted(list(seqs), inputs, passes.draft(inputs, width), width)
    assert drafted.width == width, f"a draft for width {drafted.width} verified at {width}"
    inputs, block = drafted.inputs, drafted.block
    plans = oracle.apply(seqs, block[:, 1:]) if oracle is not None else None

    # verify (a forced oracle's outcome replaces the greedy one, and sampled rows redo
    # acceptance with the lossless rule, on the device)
    logits, accepted, bonus = passes.verify(inputs, block, width)
    if plans is not None:
        accepted, bonus = oracle.settle(seqs, plans, accepted, bonus, width)
    accepted, bonus = sample_rows(passes.target, logits, block, width, seqs, accepted, bonus)
    readback = passes.read_later(torch.cat([block[:, 1:width], accepted[:, None], bonus[:, None]], dim=1))

    # draft ahead: commit the outcome and draft the next block before the host sees it
    next_draft = None
    if draft_ahead:
        passes.commit(inputs, width, accepted + 1)
        # the host knows each row's length before this verify, which keeps at most `width` more
        bound = max(s.num_cached for s in seqs) + width
        following, next_width = passes.after_verify(inputs, accepted, bonus, bound), next_width or width
        next_draft = Drafted(list(seqs), following, passes.draft(following, next_width), next_width)

    # accept: the step's one host sync
    rows = readback.tolist()
    drafts, accepted, bonus = [r[:-2] for r in rows], [r[-2] for r in rows], [r[-1] for r in rows]

    # commit: the target keeps the accepted prefix + bonus row (by length; a target with
    # recurrent state also restores that state); the engine advances num_cached
    if not draft_ahead:
        passes.commit(inputs, width, [a + 1 for a in accepted])
    return StepOutput([drafts[i][:a] + [bonus[i]] for i, a in enumerate(accepted)], accepted, next_draft)


def sample_rows(target, logits: torch.Tensor, block: torch.Tensor, width: int, seqs: list[Sequence],
                accepted: torch.Tensor, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify's outcome (accepted [bs], bonus [bs]) with the rows that sample redone by the
    lossless rule from the verify's logits [bs, width, V], rows of like settings together, on
    the device, in chunks of RULE_ELEMENTS (the rule's fp32 probabilities are a few tensors
    that size; the whole vocabulary's: on a vocabulary-parallel rank top-p gathers it)."""
    lm_head, rows_per = target.lm_head, max(1, RULE_ELEMENTS // (width * target.config.vocab_size))
    order, picked = [], []
    for group in sampled_groups([s.params for s in seqs]):
        params = seqs[group[0]].params
        for first in range(0, len(group), rows_per):
            chunk = group[first:first + rows_per]
            rows = row_index(chunk, block.device)  # the logits' device too
            dist = lm_head.distribution(logits[rows], params)
            keys = draw_keys([seqs[i] for i in chunk], 2, block.device)
            drafts = block[rows, 1:width]
            picked.append(torch.stack(speculative_sample(dist, drafts, keys)))
            order += chunk
    if not picked:
        return accepted, bonus
    outcome = torch.cat(picked, dim=1)
    accepted, bonus = accepted.clone(), bonus.clone()  # a graph's output buffers: the next replay overwrites them
    index = row_index(order, accepted.device)
    accepted[index], bonus[index] = outcome[0].to(accepted.dtype), outcome[1].to(bonus.dtype)
    return accepted, bonus
