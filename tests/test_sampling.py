"""Sampling: the target distribution, and losslessness of speculative sampling.

Chi-square tests use fixed seeds (so they are deterministic) and reject at p < 0.001.
"""

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from dflash_trt import sampling, speculate
from dflash_trt.errors import RequestError
from dflash_trt.kv_cache import Batch
from dflash_trt.loading import load_pair
from dflash_trt.sampling import Distribution, SamplingParams, target_probs
from dflash_trt.speculate import accepted_length, speculative_sample

P_MIN = 1e-3


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of counts to probs, pooling cells expected below 5 into one."""
    probs, counts = probs.double(), counts.double()
    if counts[probs == 0].sum() > 0:
        return 0.0  # a token the target can never produce
    expected = probs / probs.sum() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(temperature=1.0, top_k=2), {3, 1}),
    (SamplingParams(temperature=1.0, top_p=0.5), {3}),  # 0.53 >= 0.5: the top token alone
    (SamplingParams(temperature=1.0, top_p=0.8), {3, 1}),
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.95), {3, 1, 0}),
    (SamplingParams(temperature=1.0), {0, 1, 2, 3}),
])
def test_top_k_and_top_p_keep_the_expected_tokens(params, kept):
    logits = torch.log(torch.tensor([0.1, 0.3, 0.07, 0.53]))
    probs = target_probs(logits, params)
    assert set(probs.nonzero().flatten().tolist()) == kept
    assert probs.sum().item() == pytest.approx(1.0)


def test_top_p_within_top_k_is_top_p_over_the_sorted_vocabulary():
    # without ties the nucleus of what top-k kept is one set, however it is found
    logits = torch.randn(6, 3, 500, generator=torch.Generator().manual_seed(0)) * 2
    for top_k, top_p in ((20, 0.95), (20, 0.5), (100, 0.9), (3, 0.99)):
        params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
        kept = sampling.target_probs(logits, replace(params, top_p=1.0))
        sorted_way = kept.masked_fill(sampling._past_the_nucleus(kept, top_p, kept), 0.0)
        assert torch.allclose(sampling.target_probs(logits, params), sorted_way / sorted_way.sum(-1, keepdim=True))


@pytest.mark.parametrize("top_k, top_p", [(0, 0.3), (0, 0.9), (0, 0.99), (20, 0.9), (20, 1.0)])
def test_bf16_logits_keep_the_nucleus_of_their_fp32_copy(top_k, top_p):
    # top-k and top-p rank bf16 logits as they come (fewer key bits): their order is their
    # probabilities' (distinct multiples of 1/32, exact in bf16: no ties to break)
    logits = torch.stack([torch.randperm(200, generator=torch.Generator().manual_seed(i)) for i in range(8)]) / 32
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    half = logits.bfloat16()
    assert torch.equal(half.float(), logits)
    assert torch.equal(sampling.target_probs(half, params), sampling.target_probs(logits, params))


@pytest.mark.parametrize("top_k, top_p", [(3, 0.5), (4, 0.8), (2, 0.99), (6, 0.3)])
def test_top_p_within_top_k_keeps_a_nucleus_where_probabilities_tie(top_k, top_p):
    # integer logits over 12 tokens tie often, at the k-th and inside the nucleus
    logits = torch.randint(0, 4, (400, 12), generator=torch.Generator().manual_seed(top_k)).float()
    params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    p = sampling.target_probs(logits, replace(params, top_p=1.0))  # what top-k kept, renormalised
    kept = sampling.target_probs(logits, params) > 0
    assert (logits == logits.topk(top_k).values[:, -1:]).sum(-1).gt(1).any()  # ties at the k-th
    for row in range(len(logits)):
        mine, dropped = p[row][kept[row]], p[row][~kept[row] & (p[row] > 0)]
        assert len(mine) and (not len(dropped) or mine.min() >= dropped.max())  # the most probable first
        mass = mine.sum().item()
        assert mass - mine.min().item() < top_p + 1e-6  # the last kept one was needed...
        assert mass >= top_p - 1e-6 or not len(dropped)  # ...and they reach top_p, or are all there


def test_temperature_sharpens_the_distribution():
    logits = torch.tensor([0.0, 1.0, 2.0])
    cold, hot = target_probs(logits, SamplingParams(temperature=0.5)), target_probs(logits, SamplingParams(temperature=2))
    assert cold[2] > hot[2] and torch.allclose(cold, torch.softmax(logits / 0.5, -1))


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("max_tokens", 0), ("seed", "x"),
])
def test_bad_sampling_values_are_rejected_with_their_name(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})


def test_accepted_length_counts_leading_matches_only():
    draft = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 6, 7], [5, 9, 7]])
    target = torch.tensor([[5, 6, 7], [5, 6, 0], [5, 6, 7], [5, 6, 7]])
    assert accepted_length(draft, target).tolist() == [3, 2, 0, 1]


P0 = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0, 0.0])
P1 = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])


@pytest.mark.parametrize("draft_token", [0, 3, 4])  # likely, unlikely, impossible under P0
def test_speculative_sample_emits_exactly_the_target_distribution(draft_token):
    n = 20000  # rows drawn at once, each from its own keys
    dist = Distribution(torch.stack([P0, P1]).log().expand(n, 2, 6), SamplingParams(temperature=1.0))  # = p
    keys = torch.tensor([[sampling.stream_key(draft_token, 2 * i + j) for j in (0, 1)] for i in range(n)])
    accepted, bonus = speculative_sample(dist, torch.full((n, 1), draft_token), keys)
    first = torch.bincount(torch.where(accepted == 1, draft_token, bonus), minlength=6)
    second = torch.bincount(bonus[accepted == 1], minlength=6)
    assert chi_square_p(first, P0) > P_MIN
    if second.sum() > 0:
        assert chi_square_p(second, P1) > P_MIN


def test_rows_drawn_together_draw_what_each_draws_alone():
    # each row's randomness comes from its own keys, whatever rows are drawn beside it
    logits = torch.randn(5, 4, 40, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=0.8, top_k=20)
    drafts = Distribution(logits[:, :3], params).probs.argmax(dim=-1)  # often accepted, not always
    keys = torch.tensor([[sampling.stream_key(10 + i, j) for j in (0, 1)] for i in range(5)])
    rows = Distribution(logits[:, 0], params).draw(keys[:, 0])
    alone = [Distribution(logits[i:i + 1, 0], params).draw(keys[i:i + 1, 0])[0].item() for i in range(5)]
    assert rows.tolist() == alone
    assert len(set(rows.tolist())) > 1
    together = torch.stack(speculative_sample(Distribution(logits, params), drafts, keys), dim=1)
    alone = [torch.stack(speculative_sample(Distribution(logits[i:i + 1], params), drafts[i:i + 1], keys[i:i + 1]),
                         dim=1)[0] for i in range(5)]
    assert together.tolist() == torch.stack(alone).tolist()
    assert len(set(together[:, 0].tolist())) > 1  # rows accepted different counts


def test_rows_index_a_batch_as_a_slice_where_consecutive_else_as_a_tensor():
    x = torch.arange(10) * 10
    assert sampling.row_index([3, 4, 5], x.device) == slice(3, 6) and x[slice(3, 6)].tolist() == [30, 40, 50]
    index = sampling.row_index([0, 3, 7], x.device)
    assert isinstance(index, torch.Tensor) and x[index].tolist() == [0, 30, 70]


@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_a_seeded_sample_is_the_same_alone_or_beside_other_requests(make_pair, mode):
    # the sampled rows of one step are drawn together, grouped by their settings; a greedy row
    # among them keeps its argmax
    pair = make_pair(tokenizer_tokens=None, vocab_size=64, init_scale=0.7)
    engine = load_pair(pair.target, pair.drafter, device="cpu", max_batch_size=8, max_seq_len=64)
    prompts = [[3, 1, 4], [5, 9], [2, 6, 5, 3], [8]]
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.7, top_k=8, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=20, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.9, seed=4, ignore_eos=True)]
    together = [r.token_ids for r in engine.generate(prompts, params, mode=mode)]
    alone = [engine.generate([p], [q], mode=mode)[0].token_ids for p, q in zip(prompts, params)]
    assert together == alone
    assert together[0] != engine.generate([prompts[0]], [replace(params[0], seed=5)], mode=mode)[0].token_ids


def test_unseeded_requests_draw_apart_and_leave_torchs_generator_alone(make_pair):
    pair = make_pair(tokenizer_tokens=None, vocab_size=64, init_scale=0.7)
    engine = load_pair(pair.target, pair.drafter, device="cpu", max_batch_size=8, max_seq_len=64)
    params = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    torch.manual_seed(3)
    expected = torch.rand(())
    torch.manual_seed(3)
    outputs = [r.token_ids for r in engine.generate([[3, 1, 4]] * 4, params, mode="ar")]
    assert len({tuple(o) for o in outputs}) > 1  # each its own seed
    assert torch.rand(()) == expected  # a seed drawn by torch.seed() would have reseeded it


@pytest.mark.parametrize("rule_rows", [1, 2])
def test_a_verify_samples_the_same_in_chunks(make_pair, monkeypatch, rule_rows):
    # the rule over a few rows at a time: each row's outcome unchanged
    pair = make_pair(tokenizer_tokens=None, vocab_size=64, init_scale=0.7)
    engine = load_pair(pair.target, pair.drafter, device="cpu", max_batch_size=8, max_seq_len=64)
    prompts = [[3, 1, 4], [5, 9], [2, 6, 5, 3], [8], [7, 7]]
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=i, ignore_eos=True) for i in range(5)]
    whole = [r.token_ids for r in engine.generate(prompts, params, mode="dflash")]
    per_row = engine.block_size * 64  # a row's [width, vocab] at the full width
    monkeypatch.setattr(speculate, "RULE_ELEMENTS", rule_rows * per_row)
    assert [r.token_ids for r in engine.generate(prompts, params, mode="dflash")] == whole


@pytest.mark.parametrize("mode", ["ar", "dflash"])
def test_sampled_rows_draw_from_the_pass_logits_without_another_lm_head_pass(make_pair, monkeypatch, mode):
    # a second pass over the LM head would read its weights (a small model's largest
    # matrix) once more every step
    pair = make_pair(tokenizer_tokens=None, vocab_size=64, init_scale=0.7)
    engine = load_pair(pair.target, pair.drafter, device="cpu", max_batch_size=8, max_seq_len=64)
    passes, depth, outside = engine.passes, [], []
    for name in ("prefill", "ar", "draft", "verify"):
        def inside(*args, _pass=getattr(passes, name), **kwargs):
            depth.append(1)
            try:
                return _pass(*args, **kwargs)
            finally:
                depth.pop()
        monkeypatch.setattr(passes, name, inside)
    head = engine.target.lm_head
    head.register_forward_pre_hook(lambda module, args: None if depth else outside.append("forward"))
    logits = type(head).logits

    def noted(self, *args, **kwargs):
        if not depth:
            outside.append("logits")
        return logits(self, *args, **kwargs)
    monkeypatch.setattr(type(head), "logits", noted)
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=i, ignore_eos=True) for i in range(3)]
    results = engine.generate([[3, 1, 4], [5, 9], [8]], params, mode=mode)
    assert all(len(r.token_ids) == 12 for r in results) and outside == []


def test_the_chi_square_check_rejects_a_lossy_rule():
    # Control: "always accept the draft when it is possible" is not lossless; the same
    # check must catch it, or it would not catch a broken speculative_sample either.
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(20000):
        counts[3 if torch.rand((), generator=gen) < 0.5 else torch.multinomial(P0, 1, generator=gen)] += 1
    assert chi_square_p(counts, P0) < P_MIN


def exact_next_token_marginals(target, prompt, params, depth):
    """Exact distributions of generated tokens 1..depth, by enumerating every prefix."""
    V = target.config.vocab_size
    marginals, prefixes, weights = [], [[]], torch.ones(1, dtype=torch.float64)
    for _ in range(depth):
        seqs = [prompt + p for p in prefixes]
        n = len(seqs[0])
        cache = target.new_cache(len(seqs), n)
        device = cache.k.device
        with torch.no_grad():
            hidden, _ = target(torch.tensor(seqs, device=device), Batch.make(
                list(range(len(seqs))), [0] * len(seqs), [n] * len(seqs), n, device), cache)
            probs = target_probs(target.logits(hidden[:, -1]), params).double().cpu()  # [prefixes, V]
        joint = weights[:, None] * probs
        marginals.append(joint.sum(0))
        prefixes = [p + [t] for p in prefixes for t in range(V)]
        weights = joint.flatten()
    return marginals


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True),
    SamplingParams(max_tokens=3, temperature=0.7, top_k=6, top_p=0.9, ignore_eos=True),
])
@pytest.mark.parametrize("target", ["dense", "moe"])
def test_dflash_sampling_matches_the_target_distribution(make_pair, device, params, target):
    fields = dict(tokenizer_tokens=None, vocab_size=12, block_size=3, init_scale=0.7)
    if target == "moe":  # seed 3, scale 0.4: a pair whose random drafter overlaps the target enough
        # to get drafts accepted, with no top-p cut leaving a single token
        fields.update(num_experts=6, experts_per_tok=2, moe_intermediate_size=16, seed=3, init_scale=0.4)
    pair = make_pair(**fields)
    engine = load_pair(pair.target, pair.drafter, device=device, max_batch_size=64, max_seq_len=16)
    prompt = [3, 1, 4]
    expected = exact_next_token_marginals(engine.target, prompt, params, depth=3)
    n = 3000
    runs = {}
    for mode in ("ar", "dflash"):
        results = engine.generate([prompt] * n, [SamplingParams(**{**_fields(params), "seed": i}) for i in range(n)],
                                  mode=mode)
        runs[mode] = results
        for position in range(3):
            counts = torch.bincount(torch.tensor([r.token_ids[position] for r in results]), minlength=12).cpu()
            assert chi_square_p(counts, expected[position]) > P_MIN, (mode, position)
    # the test exercised acceptance: some drafts were accepted, some rejected
    accepted = sum(sum(a - 1 for a in r.stats.acceptance_lengths) for r in runs["dflash"])
    steps = sum(r.stats.verify_steps for r in runs["dflash"])
    assert 0.05 * steps < accepted < 1.9 * steps


def _fields(params):
    return {f: getattr(params, f) for f in params.__dataclass_fields__}
