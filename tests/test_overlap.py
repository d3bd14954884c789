"""Overlap: AR queues step n+1 on the device before the host reads step n; DFlash launches
step n+1's draft before reading step n's verify. Both must produce exactly what the serial
loop does, whatever joins, stops or is aborted."""

import random
from dataclasses import replace

import pytest

from dflash_trt import graphs
from dflash_trt.engine import Engine
from dflash_trt.loading import load_pair
from dflash_trt.sampling import SamplingParams
from dflash_trt.speculate import OracleDrafts

TARGETS = {
    "dense": dict(tokenizer_tokens=None, vocab_size=512),
    # 3 linear-attention + 1 full layers: a step for nothing advances a slot's recurrent state
    "hybrid": dict(target_type="qwen3_5", tokenizer_tokens=None, vocab_size=512, head_dim=32, rope_theta=1e7,
                   draft_rope_theta=1e7, target_layer_ids=(1, 3)),
}
PROMPTS = [[7], [3, 1, 4], [10, 20, 30, 40, 50, 60, 70], list(range(100, 119)), [5, 6]]
PARAMS = SamplingParams(max_tokens=19, ignore_eos=True)
# seeded: an overlapped engine must draw what the serial one draws, row by row
SAMPLED = [SamplingParams(max_tokens=19, ignore_eos=True, temperature=t, top_k=k, seed=i)
           for i, (t, k) in enumerate([(0.8, 0), (0.8, 0), (1.2, 20), (0.0, 0), (0.8, 0)])]


def engines(make_pair, device, kind, max_batch_size=8, **changes):
    """(an overlapped AR engine, a serial one over the same models), `changes` applied."""
    pair = make_pair(**TARGETS[kind], block_size=4)
    base = load_pair(pair.target, pair.drafter, device=device, max_seq_len=96, max_batch_size=max_batch_size)
    overlapped, serial = base.sibling(**changes), base.sibling(overlap=False, **changes)
    for engine in (overlapped, serial):
        engine.set_mode("ar")
    assert overlapped.overlap and not serial.overlap
    return overlapped, serial


def count_passes(engine, name: str) -> list[int]:
    """Count the engine's calls of one of its passes ("ar", "draft", "verify")."""
    calls, run = [0], getattr(engine.passes, name)

    def counted(*args):
        calls[0] += 1
        return run(*args)

    setattr(engine.passes, name, counted)
    return calls


@pytest.mark.parametrize("prefill_chunk", [0, 3])
@pytest.mark.parametrize("kind", TARGETS)
def test_overlapped_ar_equals_serial_ar_as_requests_join_and_leave(make_pair, device, kind, prefill_chunk):
    """Chunked, a prompt's last chunk and the running rows' step share an engine step."""
    overlapped, serial = engines(make_pair, device, kind, max_batch_size=2, prefill_chunk=prefill_chunk)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 19, 2, 11, 1)]
    (got, steps), (want, serial_steps) = drive(overlapped, PROMPTS, params), drive(serial, PROMPTS, params)
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    # a row's last step is not queued past while a request waits: its slot is prefilled next, as serially
    assert steps == serial_steps
    assert [len(g.output_ids) for g in got] == [5, 19, 2, 11, 1]
    assert {g.finish_reason for g in got} == {"length"}


def drive(engine, prompts, params):
    """Run to completion, checking that every step that decodes gives each running row a token;
    returns the sequences and the number of steps."""
    seqs, steps = [engine.add_request(p, sp) for p, sp in zip(prompts, params)], 0
    while engine.has_work():
        steps += 1
        decodes = engine.prefill_chunk or not engine.will_prefill()
        running = list(engine.running)
        tokens = {id(e.seq): len(e.new_tokens) for e in engine.step()}
        if decodes:
            assert [tokens.get(id(s)) for s in running] == [1] * len(running)
    return seqs, steps


@pytest.mark.parametrize("kind", TARGETS)
def test_a_row_that_stops_while_its_next_step_is_queued_leaves_its_slot_clean(make_pair, device, kind):
    """One slot: a stop token ends the first request after its next step was queued. That
    step runs for nothing into the slot the waiting request then takes (for a hybrid, it
    advances the slot's recurrent state): the second request must not see it."""
    overlapped, serial = engines(make_pair, device, kind, max_batch_size=1)
    free = serial.generate([PROMPTS[2]], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    index = next(i for i in range(3, 30) if free[i] not in free[:i])
    stop = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(free[index],))
    alone = serial.generate([PROMPTS[3]], PARAMS)[0].token_ids
    passes = count_passes(overlapped, "ar")
    first, second = overlapped.generate([PROMPTS[2], PROMPTS[3]], [stop, PARAMS])
    assert first.token_ids == free[: index + 1] and first.finish_reason == "stop"
    assert second.token_ids == alone
    # the first token of each comes from its prefill; the first request ran one step more
    assert passes[0] == index + 1 + PARAMS.max_tokens - 1


def test_a_greedy_batch_is_read_one_step_behind_its_launches(make_pair, device):
    overlapped, serial = engines(make_pair, device, "dense")
    seqs = [overlapped.add_request(p, PARAMS) for p in PROMPTS[:3]]
    overlapped.step()  # prefill: the first tokens
    assert overlapped.queued is None
    events = overlapped.step()
    assert [len(e.new_tokens) for e in events] == [1, 1, 1]
    assert overlapped.queued is not None and overlapped.queued.seqs == seqs
    # a request arriving now is prefilled after the queued step is read
    late = overlapped.add_request(PROMPTS[3], PARAMS)
    assert not overlapped.will_prefill()
    assert [e.seq for e in overlapped.step()] == seqs and overlapped.queued is None
    assert overlapped.will_prefill()
    assert [e.seq for e in overlapped.step()] == [late]
    while overlapped.has_work():
        overlapped.step()
    assert [s.output_ids for s in seqs + [late]] == [r.token_ids for r in serial.generate(PROMPTS[:4], PARAMS)]


def test_sampled_rows_are_queued_like_greedy_ones_but_not_by_a_serial_engine(make_pair, device):
    overlapped, serial = engines(make_pair, device, "dense")
    for engine in (overlapped, serial):
        engine.add_request(PROMPTS[0], PARAMS)
        engine.add_request(PROMPTS[1], SAMPLED[1])
        engine.step()
        assert len(engine.step()) == len(engine.running)
    assert overlapped.queued is not None and serial.queued is None


@pytest.mark.parametrize("mode", ["ar", "dflash"])
@pytest.mark.parametrize("kind", TARGETS)
def test_overlapped_sampling_draws_what_the_serial_loop_draws(make_pair, device, kind, mode):
    """Sampled rows (two settings, a greedy row beside them) are drawn on the device, so AR
    queues their next step and DFlash drafts ahead, as for greedy rows; requests join and
    leave (max_tokens apart, two slots)."""
    overlapped, serial = engines(make_pair, device, kind, max_batch_size=2)
    params = [replace(p, max_tokens=n) for p, n in zip(SAMPLED, (5, 19, 2, 11, 14))]
    queued = []
    step = overlapped.step

    def watched():
        events = step()
        queued.append(overlapped.queued is not None or overlapped.queued_draft is not None)
        return events

    overlapped.step = watched
    got = overlapped.generate(PROMPTS, params, mode=mode)
    want = serial.generate(PROMPTS, params, mode=mode)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [len(g.token_ids) for g in got] == [5, 19, 2, 11, 14] and any(queued)
    greedy = serial.generate(PROMPTS[:1], [replace(params[0], temperature=0.0)], mode=mode)[0]
    assert got[0].token_ids != greedy.token_ids  # the sampled rows did sample


@pytest.mark.parametrize("kind", TARGETS)
def test_aborting_the_rows_of_a_queued_step(make_pair, device, kind):
    overlapped, serial = engines(make_pair, device, kind, max_batch_size=2)
    a, b = overlapped.add_request(PROMPTS[1], PARAMS), overlapped.add_request(PROMPTS[2], PARAMS)
    overlapped.step()
    overlapped.step()
    overlapped.abort(a)
    assert overlapped.queued is not None  # b still wants it
    events = overlapped.step()
    assert [e.seq for e in events] == [b] and a.finish_reason == "abort" and len(a.output_ids) == 2
    overlapped.abort(b)
    assert overlapped.queued is None and not overlapped.has_work()
    # both slots were left mid-sequence: new requests start clean
    got = overlapped.generate(PROMPTS[3:5], PARAMS)
    assert [g.token_ids for g in got] == [w.token_ids for w in serial.generate(PROMPTS[3:5], PARAMS)]


# -- DFlash: the next draft launched before a step is read ---------------------------------


def dflash_engines(make_pair, device, kind, max_batch_size=8):
    pair = make_pair(**TARGETS[kind], block_size=4)
    base = load_pair(pair.target, pair.drafter, device=device, max_seq_len=96, max_batch_size=max_batch_size)
    return base, base.sibling(overlap=False)


def with_oracle(engine, refs, seed=0):
    rng = random.Random(seed)
    engine.oracle = OracleDrafts(refs, lambda seq: rng.randint(0, 4))
    return engine


@pytest.mark.parametrize("kind", TARGETS)
def test_dflash_drafting_ahead_equals_the_serial_step_as_requests_join_and_leave(make_pair, device, kind):
    overlapped, serial = dflash_engines(make_pair, device, kind, max_batch_size=2)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (5, 19, 2, 11, 30)]
    refs = {tuple(p): r.token_ids for p, r in zip(PROMPTS, serial.generate(PROMPTS, params, mode="ar"))}
    drafts, verifies = count_passes(overlapped, "draft"), count_passes(overlapped, "verify")
    got = with_oracle(overlapped, refs).generate(PROMPTS, params, mode="dflash")
    want = with_oracle(serial, refs).generate(PROMPTS, params, mode="dflash")
    assert [g.token_ids for g in got] == [w.token_ids for w in want] == list(refs.values())
    assert [g.stats.acceptance_lengths for g in got] == [w.stats.acceptance_lengths for w in want]
    # a draft per verify: rows near their end draft no further, so no draft was dropped
    assert drafts[0] == verifies[0]


def test_a_greedy_dflash_batch_drafts_its_next_step_before_reading_this_one(make_pair, device):
    overlapped, serial = dflash_engines(make_pair, device, "dense")
    overlapped.add_request(PROMPTS[1], PARAMS)
    overlapped.step()  # prefill
    overlapped.step()
    assert overlapped.queued_draft is not None and overlapped.queued_draft.seqs == overlapped.running
    # near max_tokens a row may end with this step: nothing is drafted ahead for it
    while overlapped.has_work():
        overlapped.step()
    assert overlapped.queued_draft is None
    serial.add_request(PROMPTS[1], PARAMS)
    serial.step()
    serial.step()
    assert serial.queued_draft is None


def test_a_stop_token_drops_the_draft_launched_ahead(make_pair, device):
    overlapped, serial = dflash_engines(make_pair, device, "hybrid", max_batch_size=1)
    free = serial.generate([PROMPTS[2]], SamplingParams(max_tokens=30, ignore_eos=True), mode="ar")[0].token_ids
    index = next(i for i in range(6, 30) if free[i] not in free[:i])
    stop = SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(free[index],))
    alone = serial.generate([PROMPTS[3]], PARAMS, mode="ar")[0].token_ids
    drafts, verifies = count_passes(overlapped, "draft"), count_passes(overlapped, "verify")
    first, second = overlapped.generate([PROMPTS[2], PROMPTS[3]], [stop, PARAMS], mode="dflash")
    assert first.token_ids == free[: index + 1] and first.finish_reason == "stop"
    assert second.token_ids == alone
    assert verifies[0] == len(first.stats.acceptance_lengths) + len(second.stats.acceptance_lengths)
    assert drafts[0] == verifies[0] + 1  # the first request's last step drafted for nothing


def test_each_pass_runs_in_the_context_bucket_of_its_rows_while_drafts_run_ahead(make_pair, device, monkeypatch):
    """A pass's bound on the keys its rows read (Batch.max_end, the attention's split plan, fixed
    by a CUDA graph at capture) is the context bucket above the rows' longest length + the
    block. The engine knows lengths on the host one step late when it drafts ahead: the bound
    must still cover every row, and stay within a block of the truth instead of drifting up
    by the unaccepted drafts of each step (here: buckets of 16 and 32 keys, then the capacity)."""
    monkeypatch.setattr(graphs, "CONTEXT_BUCKET_MIN", 16)
    base, _ = dflash_engines(make_pair, device, "dense", max_batch_size=2)
    engine = Engine(base.target, base.drafter, max_batch_size=2, max_seq_len=96, cuda_graphs=False)
    assert engine.passes.context_buckets == [16, 32, 100]
    seen, batch_of = [], engine.passes._batch

    def recorded(x, width):
        batch = batch_of(x, width)
        seen.append((int(x.start.max()), x.max_start, width, batch.max_end))
        return batch

    engine.passes._batch = recorded
    refs = {tuple(p): r.token_ids for p, r in zip(PROMPTS, base.generate(PROMPTS, PARAMS, mode="ar"))}
    got = with_oracle(engine, refs).generate(PROMPTS, PARAMS, mode="dflash")
    assert [g.token_ids for g in got] == list(refs.values())
    assert {max_end for *_, max_end in seen} == {16, 32, 100}
    for longest, bound, width, max_end in seen:
        assert longest <= bound < longest + engine.block_size, (longest, bound)
        assert longest + width <= max_end == next(c for c in (16, 32, 100) if c >= bound + engine.block_size)
