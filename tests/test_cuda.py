"""GPU-only checks (skipped without CUDA): bf16 DFlash against bf16 AR on mid-size pairs.
Greedy bf16 can diverge where two logits are within rounding of each other, so the contract
is a token match rate >= 99%, not identity."""

import os
import random

import pytest
import torch

from dflash_trt.loading import load_pair
from dflash_trt.sampling import SamplingParams
from dflash_trt.speculate import OracleDrafts

pytestmark = pytest.mark.cuda

MID = dict(hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
           draft_layers=2, target_layer_ids=(1, 4, 6), block_size=16, tokenizer_tokens=None, vocab_size=8192)


def prefix_match(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def teacher_forced_agreement(target, prompts, outputs, B=16) -> tuple[int, int]:
    """Feed AR's own output back through verify-shaped B-token passes (prompt prefilled first)
    and count the positions where the target's argmax equals AR's token. This isolates the
    numerical difference between the two pass shapes from the compounding after a first
    divergence."""
    from dflash_trt.kv_cache import Batch

    agree = total = 0
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs):
            cache = target.new_cache(1, 512)
            ids, n = prompt + output, len(prompt)
            target(torch.tensor([prompt], device="cuda"), Batch.make([0], [0], [n], n, "cuda"), cache)
            for start in range(n, len(ids) - 1, B):
                block = ids[start:start + B]
                hidden, _ = target(torch.tensor([block], device="cuda"),
                                   Batch.make([0], [start], [len(block)], len(block), "cuda"), cache)
                choice = target.logits(hidden)[0].argmax(-1).tolist()
                expected = ids[start + 1:start + 1 + len(block)]
                agree += sum(c == e for c, e in zip(choice, expected))
                total += len(expected)
    return agree, total


def test_bf16_verify_blocks_agree_with_ar_tokens_position_by_position(make_pair):
    pair = make_pair(**MID)
    engine = load_pair(pair.target, pair.drafter, device="cuda", dtype=torch.bfloat16, max_batch_size=32,
                       max_seq_len=512)
    gen = random.Random(1)
    prompts = [[gen.randrange(8000) for _ in range(gen.randint(4, 200))] for _ in range(32)]
    ar = engine.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True), mode="ar")
    agree, total = teacher_forced_agreement(engine.target, prompts, [r.token_ids for r in ar])
    print(f"\nbf16 random target, teacher-forced agreement of verify blocks with AR tokens: "
          f"{agree}/{total} = {agree / total:.4f}")
    # A regression guard, not the 99% contract: this random-weight target is full of
    # near-ties (see trained_pair below), and measured 98.0-98.4% here; a wrong position or
    # mask in the verify pass would drop far below 95%.
    assert agree / total >= 0.95


# A random-weight model has near-ties everywhere (median top-1/top-2 logit gap ~0.8 nats at
# logit std 4, and its hidden state is nowhere near any unembedding row), so bf16 rounding
# flips a few percent of its greedy choices whatever the pass shape. Trained models are far
# more confident. So the 99% contract is checked on a target trained for a minute on
# GSM8K text: DFLASH_TRAIN_CORPUS points at a torch file {"vocab", "seqs", "questions"} of
# token ids (bench/make_train_corpus.py makes it from ../shared/data).
CORPUS = os.environ.get("DFLASH_TRAIN_CORPUS")


@pytest.fixture(scope="module")
def trained_pair(make_pair):
    if not CORPUS:
        pytest.skip("DFLASH_TRAIN_CORPUS is not set")
    transformers = pytest.importorskip("transformers")
    data = torch.load(CORPUS)
    pair = make_pair(**{**MID, "vocab_size": (data["vocab"] + 64) // 64 * 64, "seed": 7})
    model = transformers.Qwen3ForCausalLM.from_pretrained(pair.target, dtype=torch.float32).cuda().train()
    stream = torch.tensor([t for seq in data["seqs"] for t in seq], device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    steps = int(os.environ.get("DFLASH_TRAIN_STEPS", "1500"))
    for step in range(steps):
        starts = torch.randint(0, len(stream) - 257, (32,), device="cuda", generator=gen)
        batch = torch.stack([stream[s:s + 257] for s in starts.tolist()])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    print(f"\ntrained target: {steps} steps, final loss {loss.item():.3f}")
    model.save_pretrained(pair.target)
    return pair, data["questions"]


def test_bf16_dflash_matches_bf16_ar_on_a_trained_target(trained_pair):
    pair, questions = trained_pair
    engine = load_pair(pair.target, pair.drafter, device="cuda", dtype=torch.bfloat16, max_batch_size=32,
                       max_seq_len=512)
    prompts = [q[:200] for q in questions[:32]]
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    ar = engine.generate(prompts, params, mode="ar")
    gen = random.Random(0)
    refs = {tuple(p): r.token_ids for p, r in zip(prompts, ar)}
    engine.oracle = OracleDrafts(refs, lambda seq: gen.randint(0, 15))
    dflash = engine.generate(prompts, params, mode="dflash")
    matched = sum(prefix_match(a.token_ids, d.token_ids) for a, d in zip(ar, dflash))
    total = sum(len(a.token_ids) for a in ar)
    identical = sum(a.token_ids == d.token_ids for a, d in zip(ar, dflash))
    tau = sum(sum(d.stats.acceptance_lengths) for d in dflash) / sum(d.stats.verify_steps for d in dflash)
    agree, positions = teacher_forced_agreement(engine.target, prompts, [r.token_ids for r in ar])
    print(f"\nbf16 trained target, oracle drafts: tokens matched before first divergence {matched}/{total} "
          f"= {matched / total:.4f}; identical sequences {identical}/{len(ar)}; mean acceptance length {tau:.2f}; "
          f"teacher-forced agreement {agree}/{positions} = {agree / positions:.4f}")
    assert matched / total >= 0.99
