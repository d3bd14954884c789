"""Time the routed experts of one MoE layer (ops.moe_experts) against the paths it replaces, on
Qwen3.6-35B-A3B's shape (E 256, k 8, H 2048, I 512, bf16) with random uniform routing.

  op       ops.moe_experts as the engine calls it (fused kernels, or the grouped GEMMs from
           MOE_GROUPED_MIN_PICKS_PER_EXPERT picks per expert)
  fused    the fused kernels alone (torch.ops.dflash.moe_experts)
  grouped  the torch._grouped_mm path alone (bf16, sm90+; absent otherwise)
  cublas   a loop over the picked experts as the reference runs it (gather, F.linear, silu_mul,
           F.linear, scatter, weighted sum). It needs the picked experts and their tokens on
           the host, a device-to-host sync per layer in a real pass; here they are found before
           timing, so only its GPU work is timed.
  flashinfer  FlashInfer's CUTLASS fused MoE (cutlass_fused_moe: TensorRT-LLM's kernels) where
           flashinfer imports, its workspace allocated once; timed only where its output is ours
           (checked first, with its gate and up halves in either order: the row names the one)

Every timing is the median of CUDA-event times of replays of a CUDA graph of one call (GPU work
only, launch overhead out), after warm-up; a call that cannot be captured is timed eagerly
(marked). Bytes = distinct experts picked x one expert's weight bytes + x's bytes: what a pass
must read at least; GB/s = bytes / time, next to a device-to-device copy measured here.

    python bench/moe_kernels.py --out $OUT/moe.json
    python bench/moe_kernels.py --shape 397b-a17b --tokens 1,16,512
    python bench/moe_kernels.py --shared --tokens 16,128,512   # the engine's call on Qwen3.5/3.6 MoE
    ncu --kernel-name regex:moe_token --launch-skip 8 --launch-count 4 --section SpeedOfLight \\
        python bench/moe_kernels.py --shared --tokens 1 --profile-calls 12   # one token's two kernels

--ranks R compares the two ways to split the experts over R tensor-parallel ranks, per rank, on
this one GPU (ops.moe_experts, the same routing): tensor-parallel experts (every expert, I / R
of its width: what parallel.py builds) against expert-parallel ones (E / R whole experts; a
rank skips the picks it does not own, as the kernels skip ids outside [0, E)). Both leave the
tokens on every rank and end in the same all-reduce of [N, H], so the per-rank expert time is
what differs; an expert-parallel step waits for its slowest rank, so the max over ranks counts.

    python bench/moe_kernels.py --ranks 2 --tokens 1,8,16,32,128,512 --out $OUT/moe_tp_ep.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from dflash_trt import ops, plugins

SHAPES = {  # (E, k, H, I)
    "35b-a3b": (256, 8, 2048, 512),  # Qwen3.6-35B-A3B
    "30b-a3b": (128, 8, 2048, 768),  # Qwen3-30B-A3B
    "397b-a17b": (512, 10, 4096, 1024),  # Qwen3.5-397B-A17B
}
TOKENS = (1, 8, 16, 32, 128, 256, 512, 1024, 2048, 4096)


def time_us(fn, reps: int = 50) -> tuple[float, str]:
    """Median GPU time of fn() in microseconds over `reps` graph replays (eager if capture fails)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    mode, runner, graph = "graph", fn, None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        runner = graph.replay
    except Exception:  # noqa: BLE001 - time plain launches instead
        torch.cuda.synchronize()
        mode, runner, graph = "eager", fn, None
    for _ in range(3):
        runner()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return statistics.median(times), mode


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us, _ = time_us(lambda: dst.copy_(src), reps=10)
    return 2 * src.numel() / (us * 1e-6) / 1e9  # bytes read + written


def cublas_loop(x, gate_up, down, weights, ids):
    """The reference's loop with its host work (which experts, which rows) done up front."""
    N, k = ids.shape
    picks = []
    for e in ids.unique().tolist():
        token, j = (ids == e).nonzero(as_tuple=True)
        picks.append((e, token, token * k + j))
    y = torch.zeros(N * k, x.shape[1], dtype=x.dtype, device=x.device)

    def run():
        for e, token, slot in picks:
            y.index_copy_(0, slot, F.linear(ops.silu_mul(F.linear(x[token], gate_up[e])), down[e]))
        return (y.view(N, k, -1).float() * weights[..., None]).sum(1)

    return run


def flashinfer_moe(fused_moe, x, gate_up, down, weights, ids):
    """FlashInfer's fused MoE on the same inputs -> (fn, halves) or (None, why not)."""
    E, I = gate_up.shape[0], down.shape[2]
    want = ops.moe_experts(x, gate_up, down, weights, ids).float()
    scales = weights.float().contiguous()
    size = fused_moe.cutlass_fused_moe_workspace_size(x.shape[0], x.shape[1], I, E, ids.shape[1], x_dtype=x.dtype,
                                                      weight_dtype=gate_up.dtype, output_dtype=x.dtype,
                                                      device=x.device)
    workspace = torch.empty(size, dtype=torch.uint8, device=x.device)
    out = torch.empty_like(x)
    errors = {}
    for halves in ("gate, up", "up, gate"):
        fc1 = gate_up if halves == "gate, up" else torch.cat([gate_up[:, I:], gate_up[:, :I]], dim=1)

        def run(fc1=fc1):
            return fused_moe.cutlass_fused_moe(x, ids, scales, fc1, down, x.dtype, [], output=out,
                                               workspace_buffer=workspace)

        err = ((run().float() - want).abs().max() / want.abs().max()).item()
        if err <= 2e-2:
            return run, halves
        errors[halves] = round(err, 4)
    return None, f"its output is not ours (max error / max |out|: {errors})"


def routed_inputs(shape: str, n: int, dtype: torch.dtype, shared: bool, seed: int):
    """x [n, H], weights and ids [n, k (+1)]: k distinct experts a token, uniformly at random."""
    E, k, H, I = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, H, generator=g, device="cuda").to(dtype)
    ids = torch.rand(n, E, generator=g, device="cuda").topk(k, dim=-1).indices.int()
    weights = torch.softmax(torch.randn(n, k, generator=g, device="cuda"), dim=-1)
    if shared:  # every token's last pick is expert E, as the engine packs a shared expert (models/moe.py)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], E)], dim=1)
        weights = torch.cat([weights, torch.sigmoid(torch.randn(n, 1, generator=g, device="cuda"))], dim=1)
    return x, weights, ids


def measure(shape: str, n: int, dtype: torch.dtype, gate_up, down, shared: bool = False, fused_moe=None) -> dict:
    H, I = SHAPES[shape][2:]
    x, weights, ids = routed_inputs(shape, n, dtype, shared, seed=n)
    args = (x, gate_up, down, weights, ids)
    distinct = int(ids.unique().numel())
    nbytes = distinct * 3 * I * H * gate_up.element_size() + x.numel() * x.element_size()
    grouped = dtype == torch.bfloat16 and ops._moe_grouped_fits(x, ids.numel(), gate_up.shape[0])
    row = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "tokens": n, "shared": shared,
           "distinct_experts": distinct,
           "bytes": nbytes, "op_path": "grouped" if grouped else "fused"}
    candidates = {
        "op": lambda: ops.moe_experts(*args, shared_last=shared),
        "fused": lambda: torch.ops.dflash.moe_experts(*args, True, shared),
        "cublas": cublas_loop(*args),
    }
    if dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability() >= (9, 0):
        candidates["grouped"] = lambda: ops._moe_experts_grouped(*args)
    if fused_moe is not None:
        try:
            run, halves = flashinfer_moe(fused_moe, *args)
        except Exception as err:  # noqa: BLE001 - report and go on
            run, halves = None, f"{type(err).__name__}: {err}"[:200]
        if run is None:
            row["flashinfer_error"] = halves
        else:
            candidates["flashinfer"], row["flashinfer_halves"] = run, halves
    for name, fn in candidates.items():
        try:
            us, mode = time_us(fn)
        except Exception as err:  # noqa: BLE001 - report and go on
            row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:200]
            continue
        row[f"{name}_us"], row[f"{name}_mode"] = round(us, 2), mode
        row[f"{name}_gbps"] = round(nbytes / (us * 1e-6) / 1e9, 1)
    return row


def measure_split(shape: str, n: int, ranks: int, dtype: torch.dtype) -> dict:
    """Per-rank expert time of N tokens at `ranks` ranks: tensor- vs expert-parallel experts."""
    E, k, H, I = SHAPES[shape]
    x, weights, ids = routed_inputs(shape, n, dtype, False, seed=n)
    tp_gate_up = (torch.randn(E, 2 * I // ranks, H, device="cuda") * H ** -0.5).to(dtype)
    tp_down = (torch.randn(E, H, I // ranks, device="cuda") * I ** -0.5).to(dtype)
    ep_gate_up, ep_down = tp_gate_up.new_empty(E // ranks, 2 * I, H), tp_down.new_empty(E // ranks, H, I)
    ep_gate_up.normal_(std=H ** -0.5), ep_down.normal_(std=I ** -0.5)
    tp_us, _ = time_us(lambda: ops.moe_experts(x, tp_gate_up, tp_down, weights, ids))
    ep_us, ep_picks = [], []
    for r in range(ranks):
        local = ids - r * (E // ranks)  # a pick outside [0, E / R) belongs to another rank
        ep_picks.append(int(((local >= 0) & (local < E // ranks)).sum()))
        ep_us.append(time_us(lambda: ops.moe_experts(x, ep_gate_up, ep_down, weights, local))[0])
    return {"shape": shape, "tokens": n, "ranks": ranks, "distinct_experts": int(ids.unique().numel()),
            "tp_us": round(tp_us, 2), "ep_us_per_rank": [round(t, 2) for t in ep_us], "ep_us": round(max(ep_us), 2),
            "ep_picks_per_rank": ep_picks}


def print_split(rows: list[dict]) -> None:
    print(f"{'shape':<10} {'N':>5} {'experts':>7} {'TP us':>8} {'EP us (max)':>12}  EP per rank (picks)")
    for r in rows:
        per = ", ".join(f"{t:.1f} ({p})" for t, p in zip(r["ep_us_per_rank"], r["ep_picks_per_rank"]))
        print(f"{r['shape']:<10} {r['tokens']:>5} {r['distinct_experts']:>7} {r['tp_us']:>8.1f} "
              f"{r['ep_us']:>12.1f}  {per}")


def print_table(rows: list[dict], copy: float) -> None:
    print(f"device-to-device copy: {copy:.0f} GB/s (read + written)")
    names = ("op", "fused", "grouped", "cublas", "flashinfer")
    head = f"{'shape':<10} {'N':>5} {'experts':>7} {'MB read':>8} {'op path':>8}"
    head += "".join(f" {n + ' us':>11} {n + ' GB/s':>12}" for n in names)
    print(head)
    for r in rows:
        line = f"{r['shape']:<10} {r['tokens']:>5} {r['distinct_experts']:>7} {r['bytes'] / 1e6:>8.1f} {r['op_path']:>8}"
        for n in names:
            if f"{n}_us" in r:
                mark = "*" if r[f"{n}_mode"] == "eager" else ""
                line += f" {r[f'{n}_us']:>10.1f}{mark:1} {r[f'{n}_gbps']:>12.0f}"
            else:
                line += f" {'-':>11} {'-':>12}"
        print(line)
    print("(* eager launches: the call could not be captured in a CUDA graph)")
    for r in rows:
        for key in r:
            if key.endswith("_error"):
                print(f"N={r['tokens']} {key}: {r[key]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--shape", choices=SHAPES, default="35b-a3b")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts N")
    parser.add_argument("--ranks", type=int, default=0, help="compare tensor- and expert-parallel experts per rank")
    parser.add_argument("--shared", action="store_true",
                        help="a shared expert packed as one expert more that every token picks (Qwen3.5/3.6 MoE)")
    parser.add_argument("--profile-calls", type=int, default=0,
                        help="call the op this many times per N, eagerly, new routing each time, and time nothing")
    args = parser.parse_args()
    if not torch.cuda.is_available() or plugins.load() is None:
        sys.exit("needs a CUDA GPU and the plugins")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.ranks:
        rows = [measure_split(args.shape, int(n), args.ranks, dtype) for n in args.tokens.split(",")]
        print(f"{torch.cuda.get_device_name()}, {args.shape} over {args.ranks} ranks, {args.dtype}")
        print_split(rows)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
        return
    E, k, H, I = SHAPES[args.shape]
    gate_up = (torch.randn(E + args.shared, 2 * I, H, device="cuda") * H ** -0.5).to(dtype)
    down = (torch.randn(E + args.shared, H, I, device="cuda") * I ** -0.5).to(dtype)
    if args.profile_calls:  # for a kernel profiler: the op's launches alone, nothing timed
        for n in map(int, args.tokens.split(",")):
            for call in range(args.profile_calls):
                x, weights, ids = routed_inputs(args.shape, n, dtype, args.shared, seed=call)
                ops.moe_experts(x, gate_up, down, weights, ids, shared_last=args.shared)
        torch.cuda.synchronize()
        return
    try:
        from flashinfer import fused_moe
    except ImportError:
        fused_moe = None
        print("FlashInfer is absent: its column stays empty", file=sys.stderr)
    rows = [measure(args.shape, int(n), dtype, gate_up, down, args.shared, fused_moe) for n in args.tokens.split(",")]
    copy = copy_gbps()
    shared = " + a shared expert" if args.shared else ""
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, E {E} k {k}{shared} H {H} I {I} "
          f"{args.dtype}, grouped from N k >= {ops.MOE_GROUPED_MIN_PICKS_PER_EXPERT} E")
    print_table(rows, copy)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "copy_gbps": round(copy), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
