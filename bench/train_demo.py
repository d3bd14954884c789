"""The recipe of the shipped demo pair (dflash_trt/fixtures/demo): a small Qwen3 target trained
on the Python standard library's source and GSM8K / HumanEval solutions, and its DFlash drafter
trained by `dflash-trt train` on the target's own responses. Seeded; run on a GPU (the times
each took: BENCHMARKS.md, "Trained demo pair"):

    python bench/train_demo.py corpus out/demo_train --function-prompts  # text -> token files and prompt sets
                                  # (--function-prompts: 2,221 more drafter prompts with Python 3.11's library,
                                  # its documented functions posed HumanEval's way; the target's data is the same)
    python bench/train_demo.py target out/demo_train         # the target (next-token loss, packed windows)
    dflash-trt train --target out/demo_train/target --data out/demo_train/drafter_prompts.jsonl -o out/drafter \\
        --block-size 16 --extra-block-size 8 --draft-layers 6 --intermediate-size 128 --target-layer-ids 1,2,3,4,5 \\
        --max-length 512 --num-anchors 32 --response-tokens 256 --generate-batch 256 --steps 8000 \\
        --batch-size 64 --lr 2e-3 --eval-prompts 192 --eval-max-tokens 256 --eval-temperature 0 --eval-temperature 0.7
                                  # out/drafter is the shipped drafter (the prompt file's last 192 lines are the
                                  # held-out sets: the closing evaluation's τ is theirs, mixed)
    python bench/train_demo.py eval dflash_trt/fixtures/demo --report eval.json
                                  # real τ per dataset, block 8 and 16, greedy and sampled; DFlash == AR in fp32
    python bench/train_demo.py ceiling dflash_trt/fixtures/demo --report ceiling.json
                                  # how sure the target is of its own tokens: the τ that caps

The shipped pair is the target of the `target` stage and the drafter of `dflash-trt train`
(config.json and model.safetensors of each, with the target's tokenizer files).

Text: every .py file of the running Python's standard library (PSF license), cut at top-level
def/class lines into chunks, each used twice (as plain text, and as a chat turn whose user
message is the chunk's first line and whose answer is the chunk); GSM8K test questions 128..1318
with their solutions and HumanEval problems 64..163 with their canonical solutions (both MIT,
from ../shared/data), in the shipped prompt sets' wording. The shipped sets (GSM8K 0..127,
HumanEval 0..63) are held out of both trainings: they are what `eval` measures on.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from dflash_trt.benchmark.datasets import load_prompts
from dflash_trt.engine import Engine
from dflash_trt.fixtures.tokenizer import write_qwen_tokenizer
from dflash_trt.graphs import DecodePasses
from dflash_trt.loading import load_drafter, load_target
from dflash_trt.sampling import SamplingParams
from dflash_trt.sequence import acceptance_summary
from dflash_trt.tokenizer import Tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_WRAP = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"
TOKENS = 8000  # the demo vocabulary: the first 8000 Qwen merges
TARGET = dict(hidden_size=256, intermediate_size=640, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64)  # 64: the kernels' smallest bf16 head
SEED = 2026


def stdlib_chunks() -> list[str]:
    """Top-level def/class blocks (and what precedes the first) of every stdlib .py file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for chunk in re.split(r"\n(?=(?:async def |def |class |@))", text):
            if chunk.count("\n") >= 2 and len(chunk) < 6000:
                chunks.append(chunk.strip("\n") + "\n")
    return chunks


def function_prompts(chunks: list[str]) -> list[str]:
    """HumanEval's format from the standard library: every top-level function with a docstring,
    its signature and docstring posed as a problem (HUMANEVAL_WRAP), as HumanEval poses its own."""
    prompts = []
    for chunk in chunks:
        try:
            tree = ast.parse(chunk)
        except SyntaxError:
            continue
        f = tree.body[0] if tree.body else None
        if not isinstance(f, ast.FunctionDef) or ast.get_docstring(f) is None:
            continue
        head = "\n".join(chunk.splitlines()[:f.body[0].end_lineno])  # through the docstring's last line
        if len(head) <= 1500:
            prompts.append(HUMANEVAL_WRAP.format(head.strip("\n")))
    return prompts


def chat_prompt(tok: Tokenizer, user: str) -> str:
    """A user turn in the target's chat template, ready for the answer (thinking off)."""
    return tok.apply_chat_template([{"role": "user", "content": user}], enable_thinking=False)


def chat(tok: Tokenizer, user: str, answer: str) -> list[int]:
    return tok.encode(chat_prompt(tok, user) + answer + "<|im_end|>\n")


def corpus(out: Path, with_functions: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    spec = write_qwen_tokenizer(out / "tokenizer", num_regular_tokens=TOKENS)
    tok = Tokenizer.from_dir(out / "tokenizer")
    rng = random.Random(SEED)
    chunks = stdlib_chunks()
    gsm8k = [json.loads(line) for line in (SHARED / "gsm8k" / "test.jsonl").read_text().splitlines()][128:]
    with gzip.open(SHARED / "humaneval" / "HumanEval.jsonl.gz", "rt") as f:
        humaneval = [json.loads(line) for line in f][64:]
    docs = []
    for c in chunks:
        docs.append(tok.encode(c) + [spec.eos_token_id])
        docs.append(chat(tok, c.split("\n", 1)[0], c))
    for row in gsm8k:
        reasoning, answer = row["answer"].rsplit("####", 1)
        solution = f"{reasoning.strip()}\nThe answer is \\boxed{{{answer.strip()}}}."
        docs += [chat(tok, row["question"] + GSM8K_SUFFIX, solution)] * 2
    for row in humaneval:
        docs += [chat(tok, HUMANEVAL_WRAP.format(row["prompt"].strip("\n")),
                      f"```python\n{row['prompt']}{row['canonical_solution']}```")] * 2
    rng.shuffle(docs)
    stream = torch.tensor([t for d in docs for t in d], dtype=torch.int16)  # vocabulary < 2^15
    torch.save({"tokens": stream, "vocab": spec.vocab_size, "eos": spec.eos_token_id}, out / "target_tokens.pt")
    # the drafter's prompts: chunk openings and the training questions, never the shipped sets
    # (every def line, methods' included, opens a prompt: the target continues from its signature),
    # then the shipped sets last, for `train --eval-prompts 192` to hold out and measure on
    openings = sorted({line.strip() for c in chunks for line in c.splitlines()
                       if line.lstrip().startswith(("def ", "class ")) and line.rstrip().endswith(":")})
    prompts = openings + [r["question"] + GSM8K_SUFFIX for r in gsm8k] + \
        [HUMANEVAL_WRAP.format(r["prompt"].strip("\n")) for r in humaneval]
    rng.shuffle(prompts)
    if with_functions:  # HumanEval's format, of which the rest has only its 100 training problems (shipped drafter)
        functions = function_prompts(chunks)
        prompts += functions
        random.Random(SEED + 1).shuffle(prompts)
    held_out = load_prompts("gsm8k") + load_prompts("humaneval")
    (out / "drafter_prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts + held_out))
    print(f"{sys.version.split()[0]} stdlib: {len(chunks)} chunks; {len(docs)} documents, {len(stream)} tokens; "
          f"{len(prompts)} drafter prompts, then the {len(held_out)} held-out ones")


def target(out: Path, steps: int, batch: int, length: int, lr: float, max_seconds: float) -> None:
    import transformers

    torch.manual_seed(SEED)
    data = torch.load(out / "target_tokens.pt")
    tokens, vocab = data["tokens"].long(), data["vocab"]
    rows = -(-(vocab + 1) // 64) * 64  # one row beyond the tokenizer: the drafter's mask token
    config = transformers.Qwen3Config(vocab_size=rows, max_position_embeddings=4096, rope_theta=1e6,
                                      tie_word_embeddings=True, eos_token_id=data["eos"], bos_token_id=None,
                                      torch_dtype="bfloat16", **TARGET)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.Qwen3ForCausalLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(SEED)
    start = time.perf_counter()
    for step in range(steps):
        at = torch.randint(0, len(tokens) - length, (batch,), generator=gen)
        window = torch.stack([tokens[a:a + length] for a in at.tolist()]).to(device)
        with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=window, labels=window).loss  # the model shifts the labels
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"target step {step}: loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)", flush=True)
        if time.perf_counter() - start > max_seconds:  # keep what was learned rather than lose it to a limit
            print(f"target: stopped at step {step + 1} of {steps} by --max-seconds", flush=True)
            steps = step + 1
            break
    target_dir = out / "target"
    model.to(torch.bfloat16).save_pretrained(target_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target_dir / name).write_bytes((out / "tokenizer" / name).read_bytes())
    (target_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [data["eos"]], "do_sample": False}, indent=2) + "\n")
    tokens_seen = steps * batch * length
    print(f"target: {steps} steps x {batch} x {length} = {tokens_seen / 1e6:.0f}M tokens in "
          f"{time.perf_counter() - start:.0f} s, final loss {loss.item():.3f}, peak "
          f"{torch.cuda.max_memory_allocated() / 1e9 if device == 'cuda' else 0:.1f} GB")


def evaluate(pair: Path, report_path: Path, max_tokens: int, device: str) -> None:
    tok = Tokenizer.from_dir(pair / "target")
    report = {}
    for dtype in (torch.bfloat16, torch.float32):
        target = load_target(pair / "target", device, dtype)
        drafter = load_drafter(pair / "drafter", target, device, dtype)
        for dataset in ("gsm8k", "humaneval"):
            prompts = [tok.encode(chat_prompt(tok, p)) for p in load_prompts(dataset)]
            longest = max(map(len, prompts)) + max_tokens
            for block in (16, 8):
                engine = Engine(target, drafter, max_batch_size=16, max_seq_len=longest, block_size=block)
                for temperature in ((0.0, 0.7) if dtype == torch.bfloat16 else (0.0,)):
                    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                                             stop_token_ids=tuple(tok.stop_token_ids)) for i in range(len(prompts))]
                    results = engine.generate(prompts, params, mode="dflash")
                    key = f"{dataset} block {block} T {temperature:g} {str(dtype).removeprefix('torch.')}"
                    report[key] = acceptance_summary([r.stats for r in results], block)
                    if dtype == torch.float32 and temperature == 0.0:
                        ar = engine.generate(prompts, params, mode="ar")
                        report[key]["identical_to_ar"] = all(a.token_ids == d.token_ids for a, d in zip(ar, results))
                    print(key, report[key], flush=True)
        if dtype == torch.bfloat16:
            sample = tok.encode(chat_prompt(tok, "def quicksort(arr):"))
            engine = Engine(target, drafter, max_batch_size=1, max_seq_len=len(sample) + max_tokens)
            result = engine.generate([sample], SamplingParams(max_tokens=max_tokens,
                                                              stop_token_ids=tuple(tok.stop_token_ids)))[0]
            report["quicksort"] = {"text": tok.decode(result.token_ids), "tau": result.stats.mean_acceptance_length}
            print(report["quicksort"]["text"], f"\nτ {report['quicksort']['tau']:.2f}", flush=True)
    report_path.write_text(json.dumps(report, indent=1) + "\n")


def ceiling_tau(top1: list[torch.Tensor], threshold: float, block: int) -> float:
    """τ of a drafter that names the target's own next token exactly where the target gives it a
    probability above `threshold` (top1: per response, that probability at each of its tokens):
    each step's bonus token, then drafts while the target is that sure, at most block - 1."""
    steps = tokens = 0
    for probs in top1:
        i = 0
        while i < len(probs):
            accepted = 0
            while accepted < block - 1 and i + 1 + accepted < len(probs) and probs[i + 1 + accepted] > threshold:
                accepted += 1
            steps, tokens, i = steps + 1, tokens + accepted + 1, i + accepted + 1
    return tokens / steps


class _RecordingPasses(DecodePasses):
    """Eager passes that also note, at each verify, every draft the verify shows (the accepted
    ones and the first rejected): its position in the block, the target's top-1 probability
    there and whether the draft named the target's token."""

    shown: list[tuple[int, float, bool]] = []

    def verify(self, x, block, width=None):
        logits, accepted, bonus = super().verify(x, block, width)
        top1, choice = logits.float().softmax(-1).max(-1)
        for row, a in enumerate(accepted.tolist()):
            for j in range(min(a + 1, logits.shape[1] - 1)):
                self.shown.append((j + 1, top1[row, j].item(), bool(block[row, j + 1] == choice[row, j])))
        return logits, accepted, bonus


def draft_accuracy(pair: Path, tok: Tokenizer, prompts: list[list[int]], max_tokens: int, device: str) -> dict:
    """How often the pair's drafts name the target's token, by the target's top-1 probability
    there and by position in the block (16, greedy, fp32, eager passes)."""
    target = load_target(pair / "target", device, torch.float32)
    drafter = load_drafter(pair / "drafter", target, device, torch.float32)
    engine = Engine(target, drafter, max_batch_size=16, max_seq_len=max(map(len, prompts)) + max_tokens,
                    cuda_graphs=False)
    engine.passes.__class__ = _RecordingPasses  # the eager passes, plus the notes
    _RecordingPasses.shown = []
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens, stop_token_ids=tuple(tok.stop_token_ids)),
                    mode="dflash")
    position, top1, right = (torch.tensor(c, dtype=torch.float64) for c in zip(*_RecordingPasses.shown))
    rate = lambda m: round(right[m].mean().item(), 3) if m.any() else None  # noqa: E731
    bands = ((0.0, 0.5), (0.5, 0.9), (0.9, 0.99), (0.99, 1.01))
    return {
        "drafts_shown": len(right), "right": rate(right >= 0),
        "right_by_target_top1": {f"{lo:g}-{min(hi, 1):g}": rate((top1 >= lo) & (top1 < hi)) for lo, hi in bands},
        "right_by_position": {j: rate(position == j) for j in (1, 2, 3, 4)},
        "right_by_position_where_target_top1_over_0.99": {j: rate((position == j) & (top1 >= 0.99))
                                                          for j in (1, 2, 3, 4)},
    }


def ceiling(pair: Path, report_path: Path, max_tokens: int, device: str, limit: int | None) -> None:
    """How far any drafter can get on this target: its confidence along its own greedy responses
    to the eval's prompts (fp32, transformers' model of the same checkpoint). A draft is accepted
    where it names the target's argmax; a drafter that managed that only where the target's top-1
    probability is above p reaches the τ reported per p: a flat target caps τ whatever drafts it.
    Beside it, where the pair's own drafter stands (draft_accuracy)."""
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_dir(pair / "target")
    model = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=torch.float32).to(device).eval()
    report = {}
    for dataset in ("gsm8k", "humaneval"):
        top1 = []
        prompts = [tok.encode(chat_prompt(tok, p)) for p in load_prompts(dataset, limit)]
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            with torch.no_grad():
                out = model.generate(x, max_new_tokens=max_tokens, do_sample=False, eos_token_id=tok.stop_token_ids)
                probs = model(out).logits[0, len(ids) - 1:-1].float().softmax(-1)
            top1.append(probs.max(-1).values.cpu())
        every = torch.cat(top1)
        report[dataset] = {
            "responses": len(top1), "tokens": every.numel(),
            "top1_quantiles_10_25_50": [round(every.quantile(q).item(), 3) for q in (0.1, 0.25, 0.5)],
            "share_top1_below_0.5": round((every < 0.5).float().mean().item(), 3),
            "tau_if_right_above": {f"{p:g}": {f"block {b}": round(ceiling_tau(top1, p, b), 2) for b in (8, 16)}
                                   for p in (0.3, 0.5, 0.7, 0.9)},
            "drafter": draft_accuracy(pair, tok, prompts, max_tokens, device),
        }
        print(dataset, report[dataset], flush=True)
    report_path.write_text(json.dumps(report, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("corpus", "target", "eval", "ceiling"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-seconds", type=float, default=1e9)
    parser.add_argument("--function-prompts", action="store_true",
                        help="corpus: also pose the standard library's documented functions as HumanEval problems "
                             "to the drafter")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--report", type=Path, default=Path("demo_eval.json"), help="eval, ceiling: where the JSON goes")
    parser.add_argument("--prompts", type=int, help="ceiling: the first N prompts of each set (default: all)")
    args = parser.parse_args()
    if args.stage == "corpus":
        corpus(args.out, args.function_prompts)
    elif args.stage == "target":
        target(args.out, args.steps, args.batch, args.length, args.lr, args.max_seconds)
    elif args.stage == "ceiling":
        ceiling(args.out, args.report, args.max_tokens, args.device, args.prompts)
    else:
        evaluate(args.out, args.report, args.max_tokens, args.device)


if __name__ == "__main__":
    main()
