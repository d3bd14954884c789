"""Sequence.emit keeps generated tokens up to the first stop token or max_tokens."""

import random

import pytest

from dflash_trt.sampling import SamplingParams
from dflash_trt.sequence import Sequence


def new_seq(max_tokens, stop=(), already=()):
    seq = Sequence(0, [1, 2], SamplingParams(max_tokens=max_tokens, ignore_eos=True), frozenset(stop))
    seq.output_ids = list(already)
    return seq


def emit_spec(output, tokens, max_tokens, stop):
    """The rule, one token at a time: (kept, finish_reason)."""
    kept = []
    for token in tokens:
        kept.append(token)
        if token in stop:
            return kept, "stop"
        if len(output) + len(kept) >= max_tokens:
            return kept, "length"
    return kept, None


@pytest.mark.parametrize("tokens, max_tokens, stop, already, kept, reason", [
    ([5, 6, 7], 10, {6}, [], [5, 6], "stop"),  # the stop token is kept
    ([5, 6, 7], 10, set(), [], [5, 6, 7], None),
    ([5, 6, 7], 4, set(), [1, 1], [5, 6], "length"),  # cut at max_tokens
    ([5, 6, 7], 4, {6}, [1, 1], [5, 6], "stop"),  # a stop token that is also the last allowed: stop
    ([6, 6], 10, {6}, [], [6], "stop"),
    ([], 10, {6}, [], [], None),
])
def test_emit_keeps_tokens_up_to_the_first_stop_or_max_tokens(tokens, max_tokens, stop, already, kept, reason):
    seq = new_seq(max_tokens, stop, already)
    assert seq.emit(tokens) == kept and seq.finish_reason == reason
    assert seq.output_ids == [*already, *kept] and seq.stats.output_tokens == len(already) + len(kept)
    assert (seq.stats.finish_time is not None) == (reason is not None)


def test_emit_follows_the_token_by_token_rule_on_random_steps():
    rng = random.Random(0)
    for _ in range(2000):
        max_tokens, stop = rng.randint(1, 12), set(rng.sample(range(8), rng.randint(0, 2)))
        already = [rng.randrange(8, 10) for _ in range(rng.randint(0, max_tokens - 1))]
        tokens = [rng.randrange(10) for _ in range(rng.randint(1, 17))]
        seq = new_seq(max_tokens, stop, already)
        assert (seq.emit(tokens), seq.finish_reason) == emit_spec(already, tokens, max_tokens, stop)
