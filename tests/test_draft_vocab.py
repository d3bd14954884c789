"""A pruned draft vocabulary: the drafter proposes the best of its K tokens, output stays the
target's, and build picks the corpus's most frequent tokens (stop tokens always)."""

import json
import subprocess
import sys
from collections import Counter

import pytest
import torch

from dflash_trt.benchmark.datasets import load_prompts
from dflash_trt.engine import Engine
from dflash_trt.errors import ConfigError
from dflash_trt.loading import load_drafter, load_engine, load_target
from dflash_trt.sampling import SamplingParams


def test_a_pruned_drafter_proposes_the_best_token_of_its_vocabulary(make_pair, no_tokenizer):
    pair = make_pair(**no_tokenizer)
    target = load_target(pair.target)
    drafter = load_drafter(pair.drafter, target)
    hidden = torch.randn(3, 7, target.config.dims.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = torch.randperm(512, generator=torch.Generator().manual_seed(1))[:40].sort().values
    drafter.prune_vocab(ids)
    logits = drafter.logits(hidden)
    assert torch.equal(drafter.propose(hidden), ids[logits[..., ids].argmax(dim=-1)])
    assert not torch.equal(drafter.propose(hidden), logits.argmax(dim=-1))  # the pruning is felt


@pytest.mark.parametrize("size", [1, 40])
def test_dflash_with_a_pruned_draft_vocabulary_still_equals_ar(make_pair, no_tokenizer, size):
    pair = make_pair(**no_tokenizer)
    target = load_target(pair.target)
    drafter = load_drafter(pair.drafter, target)
    drafter.prune_vocab(torch.arange(size) * 7)
    engine = Engine(target, drafter, max_batch_size=2, max_seq_len=128)
    prompts = [[7], [3, 1, 4], list(range(100, 112))]
    params = SamplingParams(max_tokens=29, ignore_eos=True)
    assert ([r.token_ids for r in engine.generate(prompts, params, mode="dflash")]
            == [r.token_ids for r in engine.generate(prompts, params, mode="ar")])


def dflash_trt(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_trt", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_build_keeps_the_corpus_most_frequent_tokens_and_the_stop_tokens(tmp_path):
    built = dflash_trt("build", "-o", tmp_path / "e", "--draft-vocab-size", 300, "--draft-vocab-corpus", "gsm8k")
    assert built.returncode == 0 and "draft vocabulary: 300 of" in built.stderr, built.stderr
    loaded = load_engine(tmp_path / "e" / "engine")
    ids = json.loads((tmp_path / "e" / "engine" / "drafter" / "draft_vocab.json").read_text())["ids"]
    tok = loaded.tokenizer
    counts = Counter(t for p in load_prompts("gsm8k") for t in tok.encode(p))
    kept = 300 - len(set(tok.stop_token_ids) - set(counts))
    most = sorted(counts, key=lambda t: (-counts[t], t))[:kept]
    assert set(ids) == set(most) | set(tok.stop_token_ids) and len(ids) == 300
    assert loaded.engine.drafter.vocab_ids.tolist() == ids
    run = dflash_trt("run", tmp_path / "e", "def quicksort(arr):", "--max-tokens", 16, "--stats")
    assert run.returncode == 0 and "mean acceptance length" in run.stderr


def test_bad_draft_vocabularies_fail_by_name(tmp_path, make_pair, no_tokenizer):
    alone = dflash_trt("build", "-o", tmp_path / "a", "--draft-vocab-size", 30)
    assert alone.returncode == 1 and "draft_vocab_size and draft_vocab_corpus go together" in alone.stderr
    big = dflash_trt("build", "-o", tmp_path / "b", "--draft-vocab-size", 10**6, "--draft-vocab-corpus", "gsm8k")
    assert big.returncode == 1 and "draft_vocab_size = 1000000 is more than" in big.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    pair = make_pair(**no_tokenizer)
    (pair.drafter / "draft_vocab.json").write_text('{"ids": [1, 1]}')
    try:
        with pytest.raises(ConfigError, match="draft_vocab.json: 'ids' must be distinct token ids"):
            load_drafter(pair.drafter, load_target(pair.target))
    finally:
        (pair.drafter / "draft_vocab.json").unlink()


def test_a_source_drafter_s_own_draft_vocabulary_is_carried_into_the_engine(make_pair, tmp_path):
    from dflash_trt.build import run
    from dflash_trt.config import resolve_config

    pair = make_pair(seed=11)  # a pair of its own: its drafter directory gets the file
    ids = sorted({*range(40), *load_target(pair.target).config.eos_token_ids})
    (pair.drafter / "draft_vocab.json").write_text(json.dumps({"ids": ids}))
    out = run(resolve_config(target=str(pair.target), drafter=str(pair.drafter), dtype="float32"), tmp_path / "o")
    assert json.loads((out / "engine" / "drafter" / "draft_vocab.json").read_text())["ids"] == ids
    assert load_engine(out / "engine").engine.drafter.vocab_ids.tolist() == ids
