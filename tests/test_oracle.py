"""Oracle acceptance: drafts from a known continuation; forced mode imposes the outcome."""

import random

import torch

from dflash_trt.loading import load_pair
from dflash_trt.sampling import SamplingParams
from dflash_trt.speculate import OracleDrafts


def test_forced_oracle_follows_the_reference_with_exactly_k_accepted(make_pair, no_tokenizer):
    """References that the target would never produce: unforced, verify rejects them;
    forced, the output is the reference and every step accepts exactly k drafts."""
    pair = make_pair(block_size=8, **no_tokenizer)
    engine = load_pair(pair.target, pair.drafter, max_batch_size=2, max_seq_len=128)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    gen = random.Random(0)
    refs = {tuple(p): [gen.randrange(500) for _ in range(40)] for p in prompts}
    sp = SamplingParams(max_tokens=33, ignore_eos=True)
    ar = [r.token_ids for r in engine.generate(prompts, sp, mode="ar")]

    engine.oracle = OracleDrafts(refs, lambda seq: 3)
    unforced = engine.generate(prompts, sp, mode="dflash")
    assert [r.token_ids for r in unforced] == ar  # wrong drafts are rejected: lossless

    engine.oracle = OracleDrafts(refs, lambda seq: 3, forced=True)
    forced = engine.generate(prompts, sp, mode="dflash")
    for p, r in zip(prompts, forced):
        # the first token comes from prefill (the target's own); the rest follow the reference
        assert r.token_ids[1:] == refs[tuple(p)][1:33]
        assert r.stats.acceptance_lengths[:-1] == [4] * (len(r.stats.acceptance_lengths) - 1)


def test_oracle_edits_only_the_first_k_drafts():
    seqs = []
    from dflash_trt.sequence import Sequence

    for i, prompt in enumerate(([1, 2], [3])):
        seq = Sequence(i, list(prompt), SamplingParams(), frozenset())
        seq.output_ids = [7]
        seqs.append(seq)
    oracle = OracleDrafts({(1, 2): [7, 20, 21, 22, 23], (3,): [7, 30]}, lambda seq: 3)
    drafts = torch.full((2, 4), -1)
    plans = oracle.apply(seqs, drafts)
    assert drafts.tolist() == [[20, 21, 22, -1], [30, -1, -1, -1]]
    assert plans == [(3, [20, 21, 22, 23]), (1, [30])]  # k, and the reference from the first draft on
    forced = OracleDrafts(oracle.references, lambda seq: 3, forced=True)
    drafts = torch.full((2, 4), -1)
    plans = forced.apply(seqs, drafts)
    assert plans == [(3, [20, 21, 22, 23]), (0, [30])]  # the reference's last token is the bonus
    assert drafts.tolist() == [[20, 21, 22, -1], [-1, -1, -1, -1]]
    verified = torch.tensor([1, 1]), torch.tensor([8, 9])  # what verify found
    accepted, bonus = forced.settle(seqs, plans, *verified, width=5)
    assert (accepted.tolist(), bonus.tolist()) == ([3, 0], [23, 30])
    accepted, bonus = forced.settle(seqs, plans, *verified, width=3)  # a narrower verify accepts at most 2
    assert (accepted.tolist(), bonus.tolist()) == ([2, 0], [22, 30])
    seqs[1].params = SamplingParams(temperature=0.7)  # a sampling row keeps verify's (the host redoes it)
    accepted, bonus = forced.settle(seqs, plans, *verified, width=5)
    assert (accepted.tolist(), bonus.tolist()) == ([3, 1], [23, 9])
    assert oracle.settle(seqs, plans, *verified, width=5) == verified  # not forced: verify's outcome


def test_forced_oracle_ends_with_a_short_reference_s_stop_token(make_pair, no_tokenizer):
    pair = make_pair(block_size=8, **no_tokenizer)
    engine = load_pair(pair.target, pair.drafter, max_batch_size=1, max_seq_len=128)
    prompt, stop = [5, 6, 7], 499
    sp = SamplingParams(max_tokens=60, stop_token_ids=(stop,))
    first = engine.generate([prompt], sp, mode="ar")[0].token_ids[0]
    reference = [first] + [100 + i for i in range(12)] + [stop]
    engine.oracle = OracleDrafts({tuple(prompt): reference}, lambda seq: 6, forced=True)
    result = engine.generate([prompt], sp, mode="dflash")[0]
    assert result.token_ids == reference and result.finish_reason == "stop"
