"""Engines refuse, with the knobs named, caches that would not fit on the GPU (checked before
allocating anything); the sizes come from "meta" caches, which must count what real ones take."""

import pytest
import torch

from dflash_trt.engine import GiB, cache_bytes, check_caches_fit
from dflash_trt.errors import ConfigError
from dflash_trt.loading import load_pair

HYBRID = dict(target_type="qwen3_5", tokenizer_tokens=None, vocab_size=512, head_dim=32, rope_theta=1e7,
              draft_rope_theta=1e7, target_layer_ids=(1, 3))


@pytest.mark.parametrize("spec", [{}, HYBRID], ids=["qwen3", "qwen3.5"])
def test_meta_caches_count_what_real_caches_allocate(make_pair, no_tokenizer, spec):
    pair = make_pair(**{**no_tokenizer, **spec})
    engine = load_pair(pair.target, pair.drafter, max_seq_len=64, max_batch_size=3)
    kw = {"num_snapshots": engine.block_size} if engine.target.stateful else {}
    for model, real, extra in ((engine.target, engine.target_cache, kw), (engine.drafter, engine.draft_cache, {})):
        meta = model.new_cache(4, real.capacity, device="meta", **extra)
        assert cache_bytes(meta) == cache_bytes(real) > 0  # 4 slots = max_batch_size + the scratch slot
        assert cache_bytes(model.new_cache(1, real.capacity, device="meta", **extra)) * 4 == cache_bytes(real)


def test_caches_that_fit_next_to_the_reserve_pass():
    check_caches_fit(per_slot=GiB, max_batch_size=31, max_seq_len=6144, free=40 * GiB, total=80 * GiB)


def test_caches_that_do_not_fit_are_refused_with_the_batch_size_that_would():
    with pytest.raises(ConfigError) as error:
        check_caches_fit(per_slot=3 * GiB, max_batch_size=16, max_seq_len=6144, free=20 * GiB, total=80 * GiB)
    message = str(error.value)
    assert "max_batch_size = 16" in message and "need 51.0 GiB (3.00 GiB per request" in message
    assert "20.0 GiB of the GPU are free" in message and "4.0 GiB are kept" in message
    assert "lower max_batch_size (at most 4 fit)" in message  # 5 slots x 3 GiB + 4 GiB <= 20 GiB


def test_when_not_even_one_request_fits_the_advice_says_so():
    with pytest.raises(ConfigError, match="not even one request fits"):
        check_caches_fit(per_slot=30 * GiB, max_batch_size=1, max_seq_len=1 << 20, free=40 * GiB, total=80 * GiB)


@pytest.mark.cuda
def test_an_engine_too_large_for_the_gpu_is_refused_before_allocating(make_pair, no_tokenizer):
    pair = make_pair(**no_tokenizer)
    free, _ = torch.cuda.mem_get_info()
    before = torch.cuda.memory_allocated()
    with pytest.raises(ConfigError, match="lower max_batch_size"):
        # the tiny pair's fp32 caches take 1.5 KiB per token and slot: 65 slots of free / 64 KiB
        # tokens ask for about 1.5 times the free memory
        load_pair(pair.target, pair.drafter, device="cuda", max_batch_size=64, max_seq_len=free // (64 * 1024) + 1)
    assert torch.cuda.memory_allocated() - before < 64 << 20  # the weights only, no caches
