"""The shipped demo pair (dflash_trt/fixtures/demo, bench/train_demo.py): a trained target and
its trained drafter, small enough to ship, lossless together, and a drafter that really drafts."""

import pytest

from dflash_trt.benchmark.datasets import load_prompts
from dflash_trt.engine import Engine
from dflash_trt.fixtures import DEMO_DIR
from dflash_trt.loading import load_drafter, load_target
from dflash_trt.sampling import SamplingParams
from dflash_trt.tokenizer import Tokenizer


def test_the_demo_weights_stay_within_the_shipping_budget():
    files = list(DEMO_DIR.glob("*/model.safetensors"))
    assert len(files) == 2 and sum(f.stat().st_size for f in files) <= 16 * 2**20


@pytest.mark.slow
def test_the_demo_drafter_accepts_several_tokens_a_step_and_dflash_equals_ar():
    tok = Tokenizer.from_dir(DEMO_DIR / "target")
    target = load_target(DEMO_DIR / "target")  # fp32 on the CPU: greedy DFlash must equal AR exactly
    drafter = load_drafter(DEMO_DIR / "drafter", target)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], enable_thinking=False))
               for p in load_prompts("gsm8k", 6) + load_prompts("humaneval", 2)]
    engine = Engine(target, drafter, max_batch_size=8, max_seq_len=1024)
    params = SamplingParams(max_tokens=48, stop_token_ids=tuple(tok.stop_token_ids))
    dflash, ar = engine.generate(prompts, params, mode="dflash"), engine.generate(prompts, params, mode="ar")
    assert [r.token_ids for r in dflash] == [r.token_ids for r in ar]
    steps = [n for r in dflash for n in r.stats.acceptance_lengths]
    # an untrained drafter accepts about one token a step (its measured τ: BENCHMARKS.md, "Trained demo pair")
    assert sum(steps) / len(steps) > 1.5, sum(steps) / len(steps)
