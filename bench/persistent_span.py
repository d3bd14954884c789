"""How much would one persistent kernel win on the weight-streaming span of a decode step?

Qwen3.6-35B-A3B's AR step at batch 1 reads its weights well below copy bandwidth
(BENCHMARKS.md, "Mixture of experts"): every kernel boundary costs a ramp and a tail. This
times, over LAYERS layers of random weights of the real shapes (distinct per layer, so the L2
holds none of them from one replay to the next), the span of a linear-attention layer between
its attention parts, for one token:

    out_proj -> add + norm -> router -> top-k -> gate_up -> down -> add + norm -> in_proj

  chain       the engine's kernels (ops.linear, ops.add_rms_norm, ops.router_logits,
              ops.moe_experts_add_rms_norm, ops.linear), as the model launches them at batch 1
  persistent  bench/persistent_span.cu: one kernel for all layers, grid barriers between the
              matmuls, with each variant (loads a lane in flight, CTAs an SM, even shares or
              pieces from a counter) and PREFETCH bytes a CTA pulls into L2 of its next share
              before each barrier (0: none)

both replayed as CUDA graphs, against the span's bytes at the copy bandwidth measured here.
The persistent kernel is checked against the chain first: its routing layer by layer (its sums'
order may flip a near tie, which then carries into the later layers) and the last output. A
measurement for a design decision, not an engine path: the kernel's sums run in another order
than the engine's.

    python bench/persistent_span.py --out $OUT/persistent_span_h200.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from dflash_trt import ops, plugins  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step import copy_bandwidth  # noqa: E402

EPS = 1e-6
TOP_K = 8  # routed picks; the shared expert is one more


def build():
    from torch.utils import cpp_extension
    return cpp_extension.load(name="persistent_span", sources=[str(Path(__file__).with_suffix(".cu"))],
                              extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90"])


def random_layers(ext, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """n layers' span weights, bf16, scaled so that activations keep unit size."""
    torch.manual_seed(seed)
    H, V, I, E, N = ext.H, ext.V, ext.I, ext.E, ext.N

    def w(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).mul_(shape[-1] ** -0.5)

    return [dict(out_proj=w(H, V), router=w(E + 1, H), gate_up=w(E + 1, 2 * I, H), down=w(E + 1, H, I),
                 in_proj=w(N, H), norm1=w(H).mul_(0.1 * H ** 0.5), norm2=w(H).mul_(0.1 * H ** 0.5))
            for _ in range(n)]


FIELDS = ("out_proj", "router", "gate_up", "down", "in_proj", "norm1", "norm2")


def chain(layers, x0, res0, tickets, logits_out=None):
    """The span through the engine's ops, layer after layer -> the last in_proj's output [1, N]."""
    x, res = x0.view(1, -1), res0.view(1, -1)
    for layer, ticket in zip(layers, tickets):
        d = ops.linear(x, layer["out_proj"])
        s, h = ops.add_rms_norm(res, d, layer["norm1"], EPS, True)
        logits = ops.router_logits(h, layer["router"])
        if logits_out is not None:
            logits_out.append(logits.clone())
        res, h2 = ops.moe_experts_add_rms_norm(h, layer["gate_up"], layer["down"], logits, TOP_K, True, True, s,
                                               layer["norm2"], EPS, True, ticket)
        z = ops.linear(h2, layer["in_proj"])
        x = z[:, :x0.numel()]
    return z


PHASES = ("x + out_proj", "norm + router", "top-k + gate_up", "SiLU + down", "weighted sum + residual",
          "norm + in_proj")


def timeline(ext, table, x0, res0, scratch, ids_out, barrier, variant: int, prefetch: int, reps: int = 5) -> dict:
    """Where one eager run's time goes, per phase (the kernel's barriers' %globaltimer stamps),
    mean us over the layers but the first and last and over `reps` runs: from the barrier before
    to the first and the last CTA's arrival at the one after, and each barrier's own latency
    (its last arrival to CTA 0's departure)."""
    L = table.shape[0]
    sums = {name: [0.0, 0.0, 0.0] for name in PHASES}
    for _ in range(reps):
        t = torch.zeros(L, 6, 3, dtype=torch.int64, device="cuda")
        t[..., 0] = torch.iinfo(torch.int64).max
        ext.run(table, x0, res0, scratch, ids_out, barrier, EPS, prefetch, variant, t)
        t = t.cpu().tolist()
        for layer in range(1, L - 1):
            for k, name in enumerate(PHASES):
                before = t[layer - 1][5][2] if k == 0 else t[layer][k - 1][2]
                first, last, leave = t[layer][k]
                for i, v in enumerate((first - before, last - before, leave - last)):
                    sums[name][i] += v / 1e3 / (reps * (L - 2))
    rows = {name: dict(first_arrival_us=round(v[0], 2), last_arrival_us=round(v[1], 2), barrier_us=round(v[2], 2))
            for name, v in sums.items()}
    print(f"timeline variant {variant}, prefetch {prefetch}: " + "; ".join(
        f"{name} {r['first_arrival_us']}/{r['last_arrival_us']}+{r['barrier_us']}" for name, r in rows.items()),
        flush=True)
    return dict(variant=variant, prefetch=prefetch, phases=rows)


def graph_us(fn, per: int, reps: int = 50) -> float:
    """Mean us per `per` (layers) of fn replayed as a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prefetch", default="0", help="bytes a CTA prefetches before a barrier, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    plugins.load()
    ext = build()
    H, V, I, E, N = ext.H, ext.V, ext.I, ext.E, ext.N
    P = TOP_K + 1
    layers = random_layers(ext, args.layers, args.seed)
    table = torch.tensor([[layer[f].data_ptr() for f in FIELDS] for layer in layers], dtype=torch.int64, device="cuda")
    x0 = torch.randn(V, device="cuda", dtype=torch.bfloat16)
    res0 = torch.randn(H, device="cuda", dtype=torch.float32)
    tickets = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in layers]
    scratch = torch.zeros(3 * H + E + 1 + P * 2 * I + H * P + N + 4096, device="cuda")
    ids_out = torch.zeros(args.layers, P, dtype=torch.int32, device="cuda")
    barrier = torch.zeros(2 + 10 * args.layers, dtype=torch.int32, device="cuda")  # and the claim counters
    no_timeline = torch.empty(0, dtype=torch.int64, device="cuda")

    # the check: routing layer by layer, and the last output, against the chain
    logits = []
    want = chain(layers, x0, res0, tickets, logits).float()
    want_ids = [ops.moe_route(lg, TOP_K, True, True)[1][0].sort().values for lg in logits]
    checks = []
    for variant in range(ext.variants):
        got = ext.run(table, x0, res0, scratch, ids_out, barrier, EPS, 0, variant, no_timeline)
        got = got.to(torch.bfloat16).float()
        torch.cuda.synchronize()
        same = [bool(torch.equal(ids_out[i].sort().values, want_ids[i])) for i in range(args.layers)]
        err = (got - want[0]).abs()
        checks.append(dict(variant=variant, grid=ext.resident_grid(variant), routing_same_per_layer=same,
                           max_abs_err=err.max().item(), mean_abs_err=err.mean().item(),
                           mean_abs_out=want.abs().mean().item()))
        print(f"check variant {variant}: routing same {sum(same)}/{len(same)}, mean |err| {err.mean().item():.4g} "
              f"(mean |out| {want.abs().mean().item():.4g}), max {err.max().item():.4g}", flush=True)

    timelines = [timeline(ext, table, x0, res0, scratch, ids_out, barrier, variant, prefetch)
                 for variant in range(ext.variants) for prefetch in map(int, args.prefetch.split(","))]

    bw = copy_bandwidth()
    span_bytes = 2 * (H * V + (E + 1) * H + P * (2 * I * H + H * I) + N * H)
    rows = [dict(path="bytes at copy bandwidth", us_per_layer=span_bytes / bw * 1e6)]
    rows.append(dict(path="chain (engine kernels)",
                     us_per_layer=graph_us(lambda: chain(layers, x0, res0, tickets), args.layers)))
    print(f"bytes {span_bytes / 1e6:.1f} MB a layer: {rows[0]['us_per_layer']:.1f} us at {bw / 1e9:.0f} GB/s; "
          f"chain {rows[1]['us_per_layer']:.1f} us", flush=True)
    for variant in range(ext.variants):
        for prefetch in map(int, args.prefetch.split(",")):
            us = graph_us(lambda: ext.run(table, x0, res0, scratch, ids_out, barrier, EPS, prefetch, variant,
                                            no_timeline),
                          args.layers)
            rows.append(dict(path="persistent", variant=variant, grid=ext.resident_grid(variant), prefetch=prefetch,
                             us_per_layer=us))
            print(f"persistent variant {variant} (grid {ext.resident_grid(variant)}), prefetch {prefetch}: "
                  f"{us:.1f} us", flush=True)
    result = dict(gpu=torch.cuda.get_device_name(), layers=args.layers, span_bytes=span_bytes,
                  copy_bandwidth_gb_s=bw / 1e9, timelines=timelines,
                  variants="0: 8 loads a lane, 1 CTA an SM, even shares; 1: 4 loads, 2 CTAs, even shares; "
                  "2, 3: as 0, 1 with pieces taken from a counter", checks=checks, rows=rows,
                  code=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                      text=True).stdout.strip() or None,
                  command="python bench/persistent_span.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
