"""Time what a step's sampled rows cost on the GPU beside greedy ones, per sampling setting:
an AR step's draw (sampling.Distribution over [rows, V], then its Gumbel-max draw) and a
verify's lossless rule (speculate.speculative_sample over [rows, width, V]), from logits in
bf16 as a decode graph leaves them, against the greedy argmax of the same logits.

Each time is the mean over `--reps` eager calls between two CUDA events (the engine launches
these ops eagerly after the graph of the pass, so their launches count), after warm-up.

    python bench/sampling_rule.py --out $OUT/sampling_rule.json
    python bench/sampling_rule.py --vocab 248320 --rows 1,8,32 --widths 8,16
"""

from __future__ import annotations

import argparse
import json

import torch
from profile_step import time_ms  # bench/, this script's folder

from dflash_trt import sampling
from dflash_trt.sampling import Distribution, SamplingParams
from dflash_trt.speculate import speculative_sample

SETTINGS = {  # name -> what a request sends
    "T 0.7": SamplingParams(temperature=0.7),
    "T 0.7, top-p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "T 0.6, top-k 20, top-p 0.95": SamplingParams(temperature=0.6, top_k=20, top_p=0.95),  # Qwen3's advice
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen3's (248320: Qwen3.5/3.6's)")
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--widths", default="5,16", help="verify widths (the adaptive width at 32 is about 5)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for n in (int(r) for r in args.rows.split(",")):
        keys = torch.tensor([[sampling.stream_key(r, j) for j in (0, 1)] for r in range(n)], device="cuda")
        for width in [1] + [int(w) for w in args.widths.split(",")]:
            shape = (n, args.vocab) if width == 1 else (n, width, args.vocab)
            logits = (3 * torch.randn(shape, generator=gen, device="cuda")).bfloat16()
            drafts = logits[:, :-1].argmax(-1) if width > 1 else None
            row = {"rows": n, "width": width, "greedy_ms": time_ms(lambda: logits.argmax(-1), args.reps)}
            for name, params in SETTINGS.items():
                if width == 1:  # an AR step's draw
                    step = lambda: Distribution(logits, params).draw(keys[:, 0])  # noqa: E731
                else:  # a verify's lossless rule
                    step = lambda: speculative_sample(Distribution(logits, params), drafts, keys)  # noqa: E731
                row[name] = time_ms(step, args.reps)
            results.append(row)
            print(", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "vocab": args.vocab, "reps": args.reps, "rows": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
