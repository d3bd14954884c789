"""Draw the plots BENCHMARKS.md embeds from the GPU runs' JSON results.

    python bench/plot_benchmarks.py [--results benchmarks/] [--out benchmarks/] [--gpu "H100 80GB HBM3"]

Reads from --results (a missing file is skipped with a note; with neither there it fails):
  bench8b.json    dflash-trt bench --random-weights qwen3-8b --oracle-tau 6.5 --concurrency 1,8,16,32 \\
                      --json benchmarks/bench8b.json
  attention.json  python bench/kernels.py --mode both --json benchmarks/attention.json
  bench9b.json, moe35b_bench.json
                  the same bench for qwen3.5-9b (--oracle-tau 7) and qwen3.6-35b-a3b (--oracle-tau 6.7)
Writes to --out:
  speedup_vs_concurrency.png  DFlash over AR (end to end and decode-only) against concurrency, and
                              the tok/s of both
  attention_vs_context.png    block attention time against context for T = 1, 8, 16 at batch 1
                              (ours solid, SDPA and FlashInfer dashed where present), and the
                              share of the copy bandwidth it reads at
  models.png                  AR and DFlash tok/s per model at each concurrency the bench files
                              share, with DFlash's speedup over AR
  ar_step_parts.png           where an AR step at batch 1 goes: what each kind of layer part costs
                              in the step (profile_step.py --ablate: ABLATION_JSONS), against the
                              whole step and the step's bytes at copy bandwidth

A developer tool: it needs matplotlib, which the package does not depend on.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from matplotlib.figure import Figure

BENCH_JSON, ATTENTION_JSON = "bench8b.json", "attention.json"
SPEEDUP_PNG, ATTENTION_PNG = "speedup_vs_concurrency.png", "attention_vs_context.png"
MODEL_JSONS, MODELS_PNG = ("bench8b.json", "bench9b.json", "moe35b_bench.json"), "models.png"
ABLATION_JSONS, ABLATION_PNG = ("moe35b_ablate_kernels.json", "qwen3_8b_ablate_h200.json"), "ar_step_parts.png"
QUERY_WIDTHS = (1, 8, 16)  # the block lengths (T) drawn in the attention plot


def model_label(engine: str | None) -> str:
    """'random:qwen3-8b' -> 'qwen3-8b shapes, random weights'; an engine directory -> its name."""
    if not engine:
        return "engine"
    if engine.startswith("random:"):
        return f"{engine.removeprefix('random:')} shapes, random weights"
    return Path(engine).name


def title_of(*parts: str | None) -> str:
    return ", ".join(p for p in parts if p)


def plot_speedup(data: dict, out: Path, gpu: str | None) -> None:
    """bench8b.json (dflash_trt.benchmark.bench.report_to_json):
    {"meta": {"engine", "url", "max_tokens", ...}, "rows": [BenchRow fields + decode_speedup], ...}."""
    meta, rows = data.get("meta") or {}, data["rows"]
    if not rows:
        raise ValueError("no rows")
    series = defaultdict(list)  # one line per dataset and acceptance mode
    for r in rows:
        series[(r["dataset"], r["mode_label"])].append(r)
    modes = sorted({m for _, m in series})
    gpu = meta.get("gpu") or meta.get("device") or gpu
    taus = sorted({round(r["tau_steps"], 2) for r in rows})
    tau_note = f"measured τ {taus[0]:.2f}" if len(taus) == 1 else f"measured τ {taus[0]:.2f}-{taus[-1]:.2f}"
    tokens = f"{meta['max_tokens']} tokens" if meta.get("max_tokens") else None

    fig = Figure(figsize=(12, 4.8), layout="constrained")  # no pyplot: files only, whatever the display
    ax_s, ax_t = fig.subplots(1, 2)
    for i, ((dataset, mode), rs) in enumerate(sorted(series.items())):
        rs.sort(key=lambda r: r["concurrency"])
        c = [r["concurrency"] for r in rs]
        color = f"C{i}"
        label = dataset if len(modes) == 1 else f"{dataset}, {mode}"
        ax_s.plot(c, [r["speedup"] for r in rs], "o-", color=color, label=f"{label}: end to end")
        ax_s.plot(c, [r["decode_speedup"] for r in rs], "s--", color=color, label=f"{label}: decode only")
        for x, r in zip(c, rs):
            ax_s.annotate(f"{r['speedup']:.2f}x", (x, r["speedup"]), textcoords="offset points", xytext=(0, -8),
                          ha="center", va="top", fontsize=8, color=color)  # below: decode-only is above
        ax_t.plot(c, [r["dflash_tok_s"] for r in rs], "o-", color=color, label=f"{label}: DFlash")
        ax_t.plot(c, [r["ar_tok_s"] for r in rs], "o--", color=color, alpha=0.6, label=f"{label}: AR")
    levels = sorted({r["concurrency"] for r in rows})
    for ax in (ax_s, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.margins(x=0.08)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_s.axhline(1, color="grey", lw=0.8)
    ax_s.set_ylim(bottom=0)
    ax_s.set_ylabel("DFlash tok/s / AR tok/s")
    ax_s.set_title("speedup of DFlash over AR")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("output tok/s (end to end, prefill included)")
    ax_t.set_title("throughput")
    fig.suptitle(title_of(model_label(meta.get("engine")), " / ".join(modes), tau_note, tokens, gpu))
    fig.savefig(out, dpi=120)


def plot_attention(data: dict, out: Path, mode: str) -> None:
    """attention.json (bench/kernels.py write_json): {"device", "torch", "copy_gbps", "flashinfer",
    "layout", "rows": [{mode, T, batch, context, ragged, num_splits, kernel_us, copy_share, sdpa_us,
    flashinfer_us, ...}]}."""
    rows = [r for r in data["rows"] if not r.get("ragged") and r.get("num_splits", "auto") == "auto"]
    present = sorted({r["mode"] for r in rows})
    if mode not in present:
        if not present:
            raise ValueError("no rows of the launch plan's own split count on uniform batches")
        print(f"{ATTENTION_JSON}: no {mode} rows, drawing {present[0]}", file=sys.stderr)
        mode = present[0]
    rows = [r for r in rows if r["mode"] == mode]
    batches = sorted({r["batch"] for r in rows})

    def line(T: int, batch: int, key: str) -> tuple[list, list]:
        pts = sorted((r["context"], r[key]) for r in rows if r["T"] == T and r["batch"] == batch
                     and r.get(key) is not None)
        return [p[0] for p in pts], [p[1] for p in pts]

    fig = Figure(figsize=(12, 4.8), layout="constrained")
    ax_t, ax_b = fig.subplots(1, 2)
    for i, T in enumerate(QUERY_WIDTHS):
        color = f"C{i}"
        for key, style, who in (("kernel_us", "o-", "ours"), ("sdpa_us", "s--", "SDPA (masked)"),
                                ("flashinfer_us", "^-.", "FlashInfer")):
            x, y = line(T, 1, key)
            if x:
                ax_t.plot(x, y, style, color=color, label=f"T = {T}: {who}")
        for batch, style in zip(batches, ("o-", "s--", "^:")):
            x, y = line(T, batch, "copy_share")
            if x:
                ax_b.plot(x, [100 * s for s in y], style, color=color, label=f"T = {T}, batch {batch}")
    contexts = sorted({r["context"] for r in rows})
    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context (cached rows per request)")
        ax.grid(True, alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.set_ylabel("us per call (one layer, CUDA-graph replay)")
    ax_t.set_title(f"{mode} attention at batch 1")
    ax_t.legend(fontsize=7, ncol=len(QUERY_WIDTHS))
    ax_b.axhline(70, color="grey", lw=0.8, ls="--")
    ax_b.annotate("goal at 32k: 70%", (contexts[-1], 70), textcoords="offset points", xytext=(-4, -11),
                  ha="right", fontsize=8, color="grey")
    ax_b.axhline(100, color="grey", lw=0.8)
    ax_b.set_ylim(bottom=0)
    ax_b.set_ylabel("K/V bytes read per s, % of device copy bandwidth")
    ax_b.set_title(f"our kernel's bandwidth ({mode})")
    ax_b.legend(fontsize=7, ncol=len(QUERY_WIDTHS))
    layout = data.get("layout") or {}
    heads = (f"{layout['q_heads']} query / {layout['kv_heads']} KV heads of {layout['head_dim']}, {layout['dtype']}"
             if {"q_heads", "kv_heads", "head_dim", "dtype"} <= layout.keys() else None)
    copy = f"copy {data['copy_gbps']:,.0f} GB/s" if data.get("copy_gbps") else None
    fi = f"FlashInfer {data['flashinfer']}" if data.get("flashinfer") else "no FlashInfer"
    torch_v = f"torch {data['torch']}" if data.get("torch") else None
    fig.suptitle(title_of("block attention", heads) + "\n" + title_of(data.get("device"), torch_v, copy, fi))
    fig.savefig(out, dpi=120)


def plot_models(results: Path, out: Path) -> None:
    """One bar group per model (the bench files of MODEL_JSONS present in `results`) and shared
    concurrency: AR and DFlash end-to-end tok/s, DFlash's speedup written over its bar."""
    runs = []
    for name in MODEL_JSONS:
        if (results / name).is_file():
            data = json.loads((results / name).read_text())
            meta = data["meta"]
            gpu = (meta.get("gpu") or "").removeprefix("NVIDIA ").split(" ")[0]
            runs.append((title_of(model_label(meta.get("engine")).split(" shapes")[0], gpu),
                         {r["concurrency"]: r for r in data["rows"]}))
    levels = sorted(set.intersection(*(set(rows) for _, rows in runs))) if runs else []
    if not levels:
        raise ValueError("no concurrency level that every bench file has")
    fig = Figure(figsize=(6 * len(levels), 4.8), layout="constrained")
    axes = fig.subplots(1, len(levels), squeeze=False)[0]
    for ax, c in zip(axes, levels):
        x = range(len(runs))
        ar = [rows[c]["ar_tok_s"] for _, rows in runs]
        df = [rows[c]["dflash_tok_s"] for _, rows in runs]
        ax.bar([i - 0.2 for i in x], ar, width=0.4, label="AR", color="C7")
        ax.bar([i + 0.2 for i in x], df, width=0.4, label="DFlash (oracle τ)", color="C0")
        for i, (_, rows) in enumerate(runs):
            ax.annotate(f"{rows[c]['speedup']:.2f}x, τ {rows[c]['tau_steps']:.1f}", (i + 0.2, df[i]),
                        textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
        ax.set_xticks(list(x), [label for label, _ in runs])
        ax.set_ylabel("output tok/s (end to end, prefill included)")
        ax.set_title(f"concurrency {c}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("AR vs DFlash per model, random weights of the real shapes, GSM8K")
    fig.savefig(out, dpi=120)


def plot_ablation(results: Path, out: Path) -> None:
    """One panel per ABLATION_JSONS file present with an ablation (profile_step.py --ablate):
    each part's cost (the full step less the step without it), the full step and the roofline
    (the step's bytes at the measured copy bandwidth) as lines."""
    runs = [json.loads((results / n).read_text()) for n in ABLATION_JSONS if (results / n).is_file()]
    runs = [d for d in runs if d.get("ablate_ar_batch1_ms")]
    if not runs:
        raise ValueError("no profile with an ablation")
    fig = Figure(figsize=(6.5 * len(runs), 4.2), layout="constrained")
    for ax, d in zip(fig.subplots(1, len(runs), squeeze=False)[0], runs):
        times = d["ablate_ar_batch1_ms"]
        parts = [(label, times["full"] - ms) for label, ms in times.items() if label != "full"]
        ax.barh([label for label, _ in parts], [cost for _, cost in parts], color="C0")
        roofline = d["batch1"]["ar_bytes_gb"] / d["copy_bandwidth_gb_s"] * 1e3
        ax.axvline(times["full"], color="C3", label=f"whole step {times['full']:.2f} ms")
        ax.axvline(roofline, color="C2", linestyle="--", label=f"its bytes at copy bandwidth {roofline:.2f} ms")
        ax.invert_yaxis()
        ax.set_xlabel("ms of the AR step at batch 1 (the step less the step without the part)")
        ax.set_title(title_of(d["preset"], d["gpu"].removeprefix("NVIDIA ")))
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Where an AR step goes (profile_step.py --ablate; parts overlap: MoE blocks hold the experts)")
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("benchmarks"),
                        help=f"the folder holding {BENCH_JSON} and {ATTENTION_JSON} (default: benchmarks/)")
    parser.add_argument("--out", type=Path, help="where the PNGs go (default: the --results folder)")
    parser.add_argument("--gpu", help=f"the GPU named in the speedup plot's title when {BENCH_JSON} names none")
    parser.add_argument("--attention-mode", choices=("causal", "non-causal"), default="causal",
                        help="which attention half to draw: causal is the target's verify (default), "
                             "non-causal the drafter's layer")
    args = parser.parse_args(argv)
    out_dir = args.out or args.results
    jobs = ((BENCH_JSON, SPEEDUP_PNG, lambda d, o: plot_speedup(d, o, args.gpu)),
            (ATTENTION_JSON, ATTENTION_PNG, lambda d, o: plot_attention(d, o, args.attention_mode)))
    jobs += ((MODEL_JSONS[0], MODELS_PNG, lambda d, o: plot_models(args.results, o)),
             (ABLATION_JSONS[0], ABLATION_PNG, lambda d, o: plot_ablation(args.results, o)))
    written, failed = 0, False
    for name, png, plot in jobs:
        src = args.results / name
        if not src.is_file():
            print(f"{src}: absent, {png} not drawn", file=sys.stderr)
            continue
        try:
            data = json.loads(src.read_text())
            out_dir.mkdir(parents=True, exist_ok=True)
            plot(data, out_dir / png)
        except (ValueError, KeyError, TypeError) as e:  # a file of another shape (JSONDecodeError included)
            print(f"{src}: cannot plot it ({type(e).__name__}: {e})", file=sys.stderr)
            failed = True
            continue
        print(out_dir / png)
        written += 1
    return 1 if failed or not written else 0


if __name__ == "__main__":
    sys.exit(main())
