"""Tensor parallelism over torch.distributed (Megatron-style): sharded models, and engines
that step in lockstep, one process per rank.

`plan(model, group)` makes a target or a drafter (built on "meta") that rank's shard, and
says how to cut each parameter, which loading.load_target / load_drafter read from the
checkpoint one tensor at a time; the model files never mention parallelism:
- attention: each rank keeps its slice of the query heads and the matching KV heads (KV heads
  are replicated when there are fewer than ranks), and o_proj's matching input columns; the
  partial outputs of o_proj are summed over the ranks (one all-reduce);
- Gated DeltaNet (Qwen3.5/3.6): each rank keeps its key heads and the value heads they serve
  (their q/k/v conv channels, z, b and a rows, decay parameters) and out_proj's matching
  columns, one all-reduce after it; the recurrent state and conv window per rank follow;
- MLP: gate/up's slice of the intermediate rows, down_proj's matching columns, one all-reduce;
- mixture of experts: tensor-parallel experts, each rank a slice of every expert's width
  (gate/up rows, down columns; the shared expert likewise), the router replicated, one
  all-reduce after the block (faster than expert parallelism for one token, about even at verify
  sizes, slower only for the 35B-A3B's largest passes: BENCHMARKS.md, "Experts over 2 ranks",
  and benchmarks/moe_tp_ep_*.json);
- embedding: vocabulary-parallel (each rank looks up its rows, the rest are zeros, all-reduce);
- LM head: vocabulary-parallel; the greedy choice gathers only each rank's best (value,
  index), and sampling only normalisers, top-k thresholds, the drafts' probabilities and
  best (value, index) pairs (top-p gathers the logits: its cut needs the sorted whole), so
  both pick as one device does;
- the drafter on the same group, the same way (its fc and norms are small and replicated).
The configs (and so the caches) take the per-rank sizes.

Every rank runs the same Engine on its shard. Rank 0's is a `Leader`: each call that changes
the engine (a request added or aborted, a step, a mode, an oracle; a sibling engine, as bench
makes per concurrency) is broadcast before it runs, and the
other ranks' `follow` loops make the same call on theirs; their collectives then meet in the
same order, and since every rank sees the same choices, all of them pick the same tokens.
`launch_followers` starts ranks 1..N-1 as child processes (`python -m dflash_trt.parallel`)
and a watchdog that ends the leader's process, with a log line, when one of them dies.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import ctypes
import dataclasses
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dflash_trt.config import LayerDims
from dflash_trt.engine import Engine
from dflash_trt.errors import ConfigError
from dflash_trt.models.moe import SparseMoeBlock
from dflash_trt.sampling import Distribution, SamplingParams, gumbel_noise


@dataclasses.dataclass(frozen=True)
class Group:
    rank: int
    size: int

    @classmethod
    def current(cls) -> "Group":
        return cls(dist.get_rank(), dist.get_world_size())


Cut = Callable[[torch.Tensor], torch.Tensor]  # a parameter's full tensor -> this rank's shard


def plan(model: nn.Module, g: Group) -> dict[str, Cut]:
    """Make `model` (a target or a drafter, loaded or still on "meta") this rank's: its config's
    sizes, its attention modules' sizes, its all-reduce hooks, a vocabulary-parallel embedding;
    returns, per parameter name, how to cut the full tensor, for weights.load_weights to load
    this rank's shard tensor by tensor: no rank ever holds the whole model."""
    check_supported(model.config, g.size)
    local = {"dims": _local_dims(model.config.dims, g)}
    if getattr(model.config, "linear", None) is not None:
        local["linear"] = _local_linear(model.config.linear, g)
    if getattr(model.config, "moe", None) is not None:
        local["moe"] = _local_moe(model.config.moe, g)
    cuts: dict[str, Cut] = {}
    layers = model.model.layers if hasattr(model, "model") else model.layers
    for name, layer in zip(_names(model, layers), layers):
        if getattr(layer, "linear_attn", None) is not None:
            _plan_gated_delta(layer.linear_attn, f"{name}.linear_attn", g, cuts)
        else:
            _plan_attention(layer.self_attn, f"{name}.self_attn", g, cuts)
        _plan_mlp(layer.mlp, f"{name}.mlp", g, cuts)
    if "lm_head" in model._modules:  # a target: vocabulary-parallel ends (the drafter borrows them)
        embed = model.model.embed_tokens.weight
        model.model.embed_tokens = VocabParallelEmbedding(embed, g)
        cuts["model.embed_tokens.weight"] = model.model.embed_tokens.cut
        cuts["lm_head.weight"] = _plan_lm_head(model.lm_head, g)
    model.config = dataclasses.replace(model.config, **local)
    model.tensor_parallel = g.size  # what an engine over it may not do alone (engine.check_verify_width)
    return cuts


def _names(model: nn.Module, layers: nn.ModuleList) -> list[str]:
    where = {m: n for n, m in model.named_modules()}
    return [where[layer] for layer in layers]


def check_supported(config, size: int) -> None:
    """Refuse, naming the field, a model whose heads or widths do not split over `size` ranks."""
    d, moe = config.dims, getattr(config, "moe", None)
    sizes = [("num_attention_heads", d.num_attention_heads), ("intermediate_size", d.intermediate_size)]
    if getattr(config, "linear", None) is not None:
        sizes += [("linear_num_key_heads", config.linear.num_key_heads),
                  ("linear_num_value_heads", config.linear.num_value_heads)]
    if moe is not None:
        sizes += [("moe_intermediate_size", moe.expert_size), ("shared_expert_intermediate_size",
                                                               moe.shared_expert_size)]
    for name, value in sizes:
        if value % size:
            raise ConfigError(f"{name} = {value} does not split over {size} ranks")
    kv = d.num_key_value_heads
    if kv % size and size % kv:
        raise ConfigError(f"num_key_value_heads = {kv} neither splits over nor replicates onto {size} ranks")


def _local_dims(d: LayerDims, g: Group) -> LayerDims:
    return dataclasses.replace(d, num_attention_heads=d.num_attention_heads // g.size,
                               num_key_value_heads=max(d.num_key_value_heads // g.size, 1),
                               intermediate_size=d.intermediate_size // g.size)


def _local_moe(moe, g: Group):
    return dataclasses.replace(moe, expert_size=moe.expert_size // g.size,
                               shared_expert_size=moe.shared_expert_size // g.size)


def _local_linear(lin, g: Group):
    return dataclasses.replace(lin, num_key_heads=lin.num_key_heads // g.size,
                               num_value_heads=lin.num_value_heads // g.size)


def _kv_heads(d: LayerDims, g: Group) -> tuple[int, int]:
    """(first KV head, count) this rank keeps: its share, or the one head its queries read."""
    if d.num_key_value_heads >= g.size:
        n = d.num_key_value_heads // g.size
        return g.rank * n, n
    return g.rank * d.num_key_value_heads // g.size, 1


def _own(width: int, g: Group) -> slice:
    n = width // g.size
    return slice(g.rank * n, (g.rank + 1) * n)


def _rows(parts: list[tuple[int, slice]], dim: int = 0) -> Cut:
    """Keep, of each stacked part starting at index `offset` of `dim`, the indices of its slice."""
    return lambda t: torch.cat([t.narrow(dim, offset + s.start, s.stop - s.start) for offset, s in parts], dim)


def _columns(own: slice) -> Cut:
    return lambda t: t[:, own]


def _plan_attention(attn: nn.Module, name: str, g: Group, cuts: dict[str, Cut]) -> None:
    """Qwen3 attention, or Qwen3.5's gated attention (whose q_proj holds each head's query
    rows and then its gate rows: per head, twice the rows)."""
    d, hd = attn.dims, attn.dims.head_dim
    q_rows = attn.qkv_proj.shards["q_proj"]
    per_head = q_rows // d.num_attention_heads
    q_heads = d.num_attention_heads // g.size
    kv_first, kv_count = _kv_heads(d, g)
    kv = slice(kv_first * hd, (kv_first + kv_count) * hd)
    own = slice(g.rank * q_heads * per_head, (g.rank + 1) * q_heads * per_head)
    cuts[f"{name}.qkv_proj.weight"] = cuts[f"{name}.qkv_proj.bias"] = _rows(
        [(0, own), (q_rows, kv), (q_rows + d.kv_size, kv)])
    cuts[f"{name}.o_proj.weight"] = _columns(slice(g.rank * q_heads * hd, (g.rank + 1) * q_heads * hd))
    attn.dims = _local_dims(d, g)
    attn.o_proj.register_forward_hook(_sum_over_ranks)


def _plan_gated_delta(layer: nn.Module, name: str, g: Group, cuts: dict[str, Cut]) -> None:
    lin = layer.lin
    k_per, v_per = lin.num_key_heads // g.size * lin.key_head_dim, lin.num_value_heads // g.size * lin.value_head_dim
    heads = lin.num_value_heads // g.size
    q, v = slice(g.rank * k_per, (g.rank + 1) * k_per), slice(g.rank * v_per, (g.rank + 1) * v_per)
    h = slice(g.rank * heads, (g.rank + 1) * heads)
    conv = [(0, q), (lin.key_size, q), (2 * lin.key_size, v)]  # the conv's q | k | v channels
    z = lin.conv_size  # then z (value channels), b and a (one row per value head each)
    b = z + lin.value_size
    cuts[f"{name}.in_proj.weight"] = _rows([*conv, (z, v), (b, h), (b + lin.num_value_heads, h)])
    cuts[f"{name}.conv1d.weight"] = _rows(conv)
    cuts[f"{name}.dt_bias"] = cuts[f"{name}.A_log"] = lambda t: t[h]
    cuts[f"{name}.out_proj.weight"] = _columns(v)
    layer.lin = _local_linear(lin, g)
    layer.out_proj.register_forward_hook(_sum_over_ranks)


def _plan_mlp(mlp: nn.Module, name: str, g: Group, cuts: dict[str, Cut]) -> None:
    if isinstance(mlp, SparseMoeBlock):
        _plan_experts(mlp, name, g, cuts)
        return
    _plan_dense(mlp, name, g, cuts)
    mlp.down_proj.register_forward_hook(_sum_over_ranks)


def _plan_dense(mlp: nn.Module, name: str, g: Group, cuts: dict[str, Cut]) -> None:
    width = mlp.down_proj.weight.shape[1]
    own = _own(width, g)
    cuts[f"{name}.gate_up_proj.weight"] = _rows([(0, own), (width, own)])
    cuts[f"{name}.down_proj.weight"] = _columns(own)


def _plan_experts(block: SparseMoeBlock, name: str, g: Group, cuts: dict[str, Cut]) -> None:
    width = block.experts.down_proj.shape[2]
    own = _own(width, g)
    cuts[f"{name}.experts.gate_up_proj"] = _rows([(0, own), (width, own)], dim=1)
    cuts[f"{name}.experts.down_proj"] = lambda t: t[:, :, own]
    if getattr(block, "shared_expert", None) is not None:  # of its own width: its partial sum joins the block's
        _plan_dense(block.shared_expert, f"{name}.shared_expert", g, cuts)
    block.moe = _local_moe(block.moe, g)
    block.register_forward_hook(_sum_over_ranks)


def _sum_over_ranks(module, inputs, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output)
    return output


def _vocab_slice(vocab: int, g: Group) -> slice:
    per = -(-vocab // g.size)  # the last rank's rows may be fewer
    return slice(min(g.rank * per, vocab), min((g.rank + 1) * per, vocab))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table; a token outside them looks up zeros, and the
    ranks' lookups are summed. Made from the whole table's parameter (`cut` keeps the rows)."""

    def __init__(self, weight: nn.Parameter, g: Group):
        super().__init__()
        self.vocab = _vocab_slice(weight.shape[0], g)
        self.weight = weight

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.vocab]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine[..., None]
        dist.all_reduce(out)
        return out


def _plan_lm_head(head: nn.Linear, g: Group) -> Cut:
    vocab = head.weight.shape[0]
    per = -(-vocab // g.size)
    own = _vocab_slice(vocab, g)

    def gather(module, inputs, logits: torch.Tensor) -> torch.Tensor:
        # equal sizes for all_gather: the last rank pads, the padding is cut after
        padded = F.pad(logits, (0, per - logits.shape[-1]))
        parts = [torch.empty_like(padded) for _ in range(g.size)]
        dist.all_gather(parts, padded.contiguous())
        return torch.cat(parts, dim=-1)[..., :vocab]

    def greedy(logits: torch.Tensor) -> torch.Tensor:
        # each rank's best (value, index) travels, not its slice of the logits: at a verify
        # of many rows that slice is tens of MB per rank
        return _best_over_ranks(logits, own.start, g)

    def distribution(logits: torch.Tensor, params: SamplingParams) -> Distribution:
        if params.top_p < 1:  # the nucleus is cut from the whole sorted distribution: gathered
            return Distribution(gather(head, (), logits), params)
        return VocabParallelDistribution(logits.float(), params, own, vocab, g)

    head.register_forward_hook(gather)
    head.greedy, head.distribution = greedy, distribution
    return lambda t: t[own]


def _best_over_ranks(score: torch.Tensor, start: int, g: Group) -> torch.Tensor:
    """The vocabulary index of the largest of every rank's local scores [..., V_r] -> [...].
    Indices travel as fp32, exact for vocabularies < 2^24; the first rank holding the maximum
    has the lowest index, so ties resolve as one device's argmax does."""
    best, where = score.max(dim=-1)
    mine = torch.stack([best.float(), (where + start).float()], dim=-1)
    parts = [torch.empty_like(mine) for _ in range(g.size)]
    dist.all_gather(parts, mine)
    ranked = torch.stack(parts)  # [ranks, ..., 2]
    winner = ranked[..., 0].argmax(dim=0, keepdim=True)
    return ranked[..., 1].gather(0, winner)[0].long()


class VocabParallelDistribution:
    """sampling.Distribution over this rank's vocabulary slice: the normaliser (and top-k's
    threshold) come from small collectives, a probability from its owner, a draw from the
    Gumbel-max trick over the slices with every rank drawing the whole vocabulary's noise
    (so the draw is the one a single device makes with the same keys). Logits never
    leave their rank."""

    def __init__(self, local: torch.Tensor, params: SamplingParams, own: slice, vocab: int, g: Group):
        self.own, self.vocab, self.g = own, vocab, g
        logits = local / params.temperature
        if params.top_k and params.top_k < vocab:
            # the global k-th largest is among the ranks' own k largest
            top = F.pad(logits, (0, max(0, params.top_k - logits.shape[-1])), value=float("-inf"))
            mine = top.topk(params.top_k, dim=-1).values.contiguous()
            parts = [torch.empty_like(mine) for _ in range(g.size)]
            dist.all_gather(parts, mine)
            kth = torch.cat(parts, dim=-1).topk(params.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        peak = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        mass = (logits - peak).exp().sum(dim=-1, keepdim=True)
        dist.all_reduce(mass)
        self.logp = logits - peak - mass.log()  # [n, ..., V_r]

    def probs_of(self, tokens: torch.Tensor) -> torch.Tensor:
        local, mine = self._local(tokens)
        p = self.logp[:, :tokens.shape[1]].gather(-1, local[..., None])[..., 0].exp() * mine
        dist.all_reduce(p)  # from the rank that holds the token; zeros from the others
        return p

    def at(self, positions: torch.Tensor) -> "VocabParallelDistribution":
        picked = copy.copy(self)
        picked.logp = self.logp[torch.arange(len(positions), device=positions.device), positions][:, None]
        return picked

    def draw(self, keys: torch.Tensor, exclude: torch.Tensor | None = None) -> torch.Tensor:
        shape = (*self.logp.shape[:-1], self.vocab)
        noise = gumbel_noise(math.prod(shape[1:]), keys).view(shape)[..., self.own]
        score = noise + self.logp
        if exclude is not None:
            local, mine = self._local(exclude)
            part = score[:, :exclude.shape[1]]
            part.scatter_(-1, local[..., None], torch.where(mine[..., None], float("-inf"),
                                                           part.gather(-1, local[..., None])))
        return _best_over_ranks(score, self.own.start, self.g)

    def _local(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens as indices into this rank's slice (clamped), and which of them it holds."""
        local = tokens - self.own.start
        mine = (local >= 0) & (local < self.logp.shape[-1])
        return local.clamp(0, self.logp.shape[-1] - 1), mine


# -- ranks in lockstep ------------------------------------------------------------------------


class Leader(Engine):
    """Rank 0's engine: what changes it is broadcast first, for the followers to repeat."""

    def add_request(self, prompt_ids: list[int], params: SamplingParams):
        if not params.greedy and params.seed is None:  # every rank must draw the same numbers
            params = dataclasses.replace(params, seed=int(torch.randint(0, 2**62, ()).item()))
        seq = super().add_request(prompt_ids, params)  # a bad request raises before any rank hears of it
        broadcast(("add_request", (list(prompt_ids), params)))
        return seq

    def abort(self, seq) -> None:
        broadcast(("abort", seq.request_id))
        super().abort(seq)

    def step(self):
        broadcast(("step", None))
        with _marks_broken():
            return super().step()

    def set_mode(self, mode: str) -> None:
        super().set_mode(mode)
        broadcast(("set_mode", mode))

    def warm_up(self) -> None:
        broadcast(("warm_up", None))
        with _marks_broken():
            super().warm_up()

    def sibling(self, **changes) -> "Leader":
        broadcast(("sibling", changes))  # the followers' engine becomes its sibling too
        with _marks_broken():
            return super().sibling(**changes)

    def set_oracle(self, oracle) -> None:
        broadcast(("set_oracle", oracle))  # pickled: references, the draw (its RNG unused yet), forced
        super().set_oracle(oracle)

    def release(self) -> None:
        """End the followers' `follow` loops (serving never does: they end with the leader)."""
        broadcast(("stop", None))


def follow(engine: Engine) -> None:
    """Repeat the leader's calls on this rank's engine until it releases them, or for as long
    as the leader lives (a follower ends with it: launch_followers)."""
    seqs = {}
    while True:
        op, arg = broadcast(None)
        if op == "stop":
            return
        if op == "add_request":
            seq = engine.add_request(*arg)
            seqs[seq.request_id] = seq
        elif op == "abort":
            if arg in seqs:
                engine.abort(seqs.pop(arg))
        elif op == "step":
            for event in engine.step():
                if event.finished:
                    seqs.pop(event.seq.request_id, None)
        elif op == "set_mode":
            engine.set_mode(arg)
        elif op == "warm_up":
            engine.warm_up()
        elif op == "sibling":
            engine, seqs = engine.sibling(**arg), {}
        elif op == "set_oracle":
            engine.set_oracle(arg)


def broadcast(message):
    """Rank 0's `message` (any picklable object), on every rank."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# -- processes --------------------------------------------------------------------------------

TIMEOUT = timedelta(minutes=10)  # a collective that waits longer than this fails instead of hanging


def share_cpu_threads(size: int) -> None:
    """Give this CPU rank its share of the cores for its intra-op threads (torchrun gives each rank
    one), unless OMP_NUM_THREADS says how many: `size` ranks that each take every core only
    contend, and a collective waits for the slowest of them."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // size))


def init(rank: int, size: int, rendezvous: str, device: str) -> None:
    """Join the group: NCCL on GPUs (rank r on cuda:r), gloo on the CPU (each rank its share of
    the cores)."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        share_cpu_threads(size)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=size, timeout=TIMEOUT)


def join_as_leader(engine_dir: Path, size: int, device: str, draft_window: int | None = None) -> None:
    """Make this process rank 0 of `size`, starting the other ranks, unless it is in a group
    already (a follower, or a leader loading again)."""
    if dist.is_initialized():
        if dist.get_world_size() != size:
            raise ConfigError(f"{engine_dir} was built for {size} tensor-parallel ranks, this group has "
                              f"{dist.get_world_size()}")
        return
    if device == "cuda" and torch.cuda.device_count() < size:
        raise ConfigError(f"{engine_dir} was built for {size} GPUs (tensor parallelism), this machine has "
                          f"{torch.cuda.device_count()}")
    rendezvous, procs = launch_followers(engine_dir, size, device, draft_window)
    init(0, size, rendezvous, device)
    atexit.register(_end_group, procs)  # after the group is up; runs before the folder's removal


def launch_followers(engine_dir: Path, size: int, device: str,
                     draft_window: int | None = None) -> tuple[str, list[subprocess.Popen]]:
    """Start ranks 1..size-1 for `engine_dir` and a watchdog over them; returns the rendezvous
    file rank 0 joins with (init) and the processes. A follower that dies ends this process
    (exit 1); a follower whose leader dies gets SIGTERM (Linux parent-death signal)."""
    folder = tempfile.mkdtemp(prefix="dflash-trt-tp-")
    # the group's file store lives as long as the group: the leader removes it when it exits
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    rendezvous = os.path.join(folder, "rendezvous")
    # in a Triton stub sys.executable is the stub; its PATH starts with the serving venv's bin
    python = sys.executable if Path(sys.executable).name.startswith("python") else "python3"
    args = [str(engine_dir), str(size), rendezvous, device, "" if draft_window is None else str(draft_window)]
    procs = [subprocess.Popen([python, "-m", "dflash_trt.parallel", args[0], str(rank), *args[1:]],
                              preexec_fn=_die_with_parent) for rank in range(1, size)]
    threading.Thread(target=_watch, args=(procs,), name="dflash-tp-watchdog", daemon=True).start()
    return rendezvous, procs


_ending = threading.Event()  # set when the leader ends the group: its followers' exits are expected
_broken = False  # a leader's call failed, maybe between collectives: the followers cannot be released


@contextlib.contextmanager
def _marks_broken():
    global _broken
    try:
        yield
    except BaseException:
        _broken = True
        raise


def _end_group(procs: list[subprocess.Popen]) -> None:
    """At the leader's exit: release the followers (they wait for its next call) and end the
    group with them. An NCCL group that the leader alone leaves blocks its exit (on 2 H100s
    `run` printed its answer and never returned; gloo does not block). After a failed call
    the followers may sit in another collective, so they are killed instead."""
    _ending.set()
    if _broken or any(proc.poll() is not None for proc in procs):  # nobody to release, or not safely
        for proc in procs:
            proc.kill()
        return
    if not dist.is_initialized():
        return
    broadcast(("stop", None))
    dist.destroy_process_group()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def leave(code: int = 0) -> None:
    """End a rank's process, its group destroyed, without the interpreter's teardown: there
    gloo's worker threads sometimes abort the process after its work is done (SIGABRT,
    "terminate called without an active exception"; pytorch/pytorch#179291), which a parent
    waiting for the rank would take for a failure (seen on the loaded 2-core CI machine)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _watch(procs: list[subprocess.Popen]) -> None:
    while not _ending.is_set():
        for rank, proc in enumerate(procs, start=1):
            code = proc.poll()
            if code is not None and not _ending.is_set():
                print(f"dflash-trt: tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}; "
                      "stopping the other ranks and this process", file=sys.stderr, flush=True)
                for other in procs:
                    if other.poll() is None:
                        other.kill()
                os._exit(1)
        time.sleep(0.2)


def _follower_main(argv: list[str]) -> int:
    """python -m dflash_trt.parallel ENGINE_DIR RANK SIZE RENDEZVOUS DEVICE [DRAFT_WINDOW]"""
    from dflash_trt.loading import load_engine  # loading imports this module

    engine_dir, rank, size, rendezvous, device = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4]
    window = int(argv[5]) if len(argv) > 5 and argv[5] else None
    init(rank, size, rendezvous, device)
    try:
        follow(load_engine(Path(engine_dir), device, window, size).engine)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_follower_main(sys.argv[1:]))
