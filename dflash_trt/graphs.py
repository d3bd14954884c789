"""The passes of a step (prefill, AR step, draft, verify), eager or replayed as CUDA graphs.

The decode passes have a fixed shape per batch size (and verify width), so on CUDA each is
captured once per batch-size bucket (and width, and context bucket: below) and replayed: a replay is one launch instead
of thousands, which is most of the step time at small batch.
Rows past the real batch size are padding: they point at a scratch cache slot (the last
one, never given to a request) at position 0.

A prefill has a new length every time. One whole prompt of up to PREFILL_WIDTHS[-1] tokens
(what a request arriving alone brings) is padded to the next of those widths and replayed
too: launched eagerly, its few thousand kernels cost more host time than the GPU spends on
a short prompt. The padding tokens write cache rows past the prompt, which the next pass
overwrites before anything reads them, as a verify's rejected rows (kv_cache.py); a hybrid
target's recurrence stops at each row's last real token. Anything else (several prompts,
a chunk of a longer one) runs eagerly.

Nothing inside a pass reads device values on the host: lengths travel as device tensors.
The attention kernel cuts its work by a host-side bound on the keys a row may read, which a
graph fixes at capture. So a decode graph is captured per context bucket too (from
CONTEXT_BUCKET_MIN keys, doubling, up to the cache's capacity; a step takes the smallest above
its longest row and block): a short context does not run the split plan of the longest one
the cache can hold (BENCHMARKS.md, "Engine: AR vs DFlash"). The engine reads results once per
step (speculate.speculative_step, Engine._decode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_trt import ops, plugins
from dflash_trt.kv_cache import Batch, KVCache
from dflash_trt.sequence import Sequence
from dflash_trt.speculate import accepted_length

# The padded widths of a graphed prefill. Up to a few hundred tokens a prefill at batch 1
# reads the weights once and is bound by that, so padding costs little; larger buckets
# would pad more compute (BENCHMARKS.md, "Prefill graphs").
PREFILL_WIDTHS = (32, 64, 128, 256, 512)

# The first context bucket of the decode graphs (DecodePasses.context_buckets); each next one
# doubles, the last is the cache's capacity. Below this many keys the attention's plan hardly
# changes with the bound.
CONTEXT_BUCKET_MIN = 512


@dataclass(frozen=True)
class StepInputs:
    """Per running sequence, on the device: its slot, committed length and last token, as
    the rows of one [3, m] tensor (one copy moves them all); columns past `size` are a
    graph bucket's padding rows. `max_start`, on the host, bounds the rows' committed
    lengths: what the attention's split plan is sized for."""

    packed: torch.Tensor  # [3, m] long, m >= size
    size: int
    max_start: int

    @property
    def slots(self) -> torch.Tensor:
        return self.packed[0, : self.size]

    @property
    def start(self) -> torch.Tensor:
        return self.packed[1, : self.size]

    @property
    def last_tokens(self) -> torch.Tensor:
        return self.packed[2, : self.size]


@dataclass(frozen=True)
class Readback:
    """Tokens on their way to the host: a pinned buffer and the event after its copy."""

    host: torch.Tensor
    done: torch.cuda.Event | None  # None on the CPU, where the copy was synchronous

    def tolist(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class DecodePasses:
    """Eager decode passes over the engine's models and caches."""

    def __init__(self, target, drafter, target_cache: KVCache, draft_cache: KVCache | None, taps: tuple[int, ...],
                 block_size: int):
        self.target, self.drafter = target, drafter
        self.target_cache, self.draft_cache, self.taps = target_cache, draft_cache, taps
        self.block_size = block_size
        self.device = target_cache.k.device
        capacity = target_cache.capacity
        # doubling from CONTEXT_BUCKET_MIN while the next is no larger than the capacity, then
        # the capacity (not a bucket just under it)
        self.context_buckets = [c for c in (CONTEXT_BUCKET_MIN << i for i in range(capacity.bit_length()))
                                if 2 * c <= capacity] + [capacity]
        # Pinned staging buffers: a step's inputs go to the device in one async copy, its
        # tokens come back in another. Two of each, used in turn: an AR step may be queued
        # before the previous one is read back (Engine, overlap), so one copy can still be
        # pending while the next step's inputs are written; every step is read back (a host
        # sync) before the step after next is staged, so a buffer is free when its turn comes
        # (a DFlash step drafted ahead reuses its turn's readback: it reads one before the
        # next verify's copy is queued).
        # Flat, so the [3, m] view of any m is contiguous (a strided one would be copied
        # through a pageable temporary).
        pinned = self.device.type == "cuda"
        slots = target_cache.k.shape[1]
        self._staging = torch.zeros((2, 3 * slots), dtype=torch.long, pin_memory=pinned)
        self._readback = torch.zeros((2, slots * (block_size + 1)), dtype=torch.long, pin_memory=pinned)
        self._turn = 0

    def _host_rows(self, m: int) -> torch.Tensor:
        return self._staging[self._turn, : 3 * m].view(3, m)

    def _staged(self, n: int) -> torch.Tensor:
        """The pinned [3, m >= n] rows that n sequences' inputs are written into."""
        return self._host_rows(n)

    def inputs(self, seqs: list[Sequence]) -> StepInputs:
        rows = [[s.slot for s in seqs], [s.num_cached for s in seqs], [s.last_token for s in seqs]]
        return StepInputs(self._upload(rows), len(seqs), max(rows[1], default=0))

    def next_inputs(self, seqs: list[Sequence], rows: list[int], tokens: torch.Tensor) -> StepInputs:
        """Inputs of the AR step after one the host has not read yet: each sequence one row
        past its num_cached, its last token the queued step's token tokens[rows[i]] (greedy or
        drawn on the device), gathered on the device (no host sync)."""
        n, lengths = len(seqs), [s.num_cached + 1 for s in seqs]
        packed = self._upload([[s.slot for s in seqs], lengths, rows])
        packed[2, :n] = tokens[packed[2, :n]]
        return StepInputs(packed, n, max(lengths, default=0))

    def _upload(self, rows: list[list[int]]) -> torch.Tensor:
        """The [3, n] rows staged in the next pinned buffer and copied to the device -> [3, m >= n]."""
        n = len(rows[0])
        self._turn ^= 1
        host = self._staged(n)
        host[:, :n] = torch.tensor(rows)
        return host.to(self.device, non_blocking=True)

    def after_verify(self, x: StepInputs, accepted: torch.Tensor, bonus: torch.Tensor, max_start: int) -> StepInputs:
        """The inputs of the step after a verify, from its outcome on the device: each row's
        committed length past its accepted drafts and bonus, the bonus its last token.
        `max_start` bounds the new lengths on the host (the verified rows' lengths before it
        plus its width)."""
        packed = x.packed.clone()
        packed[1, : x.size] += accepted + 1
        packed[2, : x.size] = bonus
        return StepInputs(packed, x.size, max_start)

    def read_later(self, values: torch.Tensor) -> "Readback":
        """Start copying a step's results ([n] or [n, w] longs) to the host; Readback.tolist
        waits for them."""
        host = self._readback[self._turn, : values.numel()].view(values.shape)
        host.copy_(values, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Readback(host, done)

    def prefill(self, slots: list[int], starts: list[int], chunks: list[list[int]], dflash: bool,
                done: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Cache the prompt tokens chunks[i] of row i (slot slots[i]) from position starts[i] on,
        with `dflash` the drafter's context K/V of those tokens too -> (logits [d, V], greedy
        next token [d]) at the last token of the rows `done` (those whose prompt this
        completes), None if there are none."""
        counts = [len(c) for c in chunks]
        ids = torch.zeros((len(chunks), max(counts)), dtype=torch.long)
        for i, chunk in enumerate(chunks):
            ids[i, : counts[i]] = torch.tensor(chunk)
        batch = Batch.make(slots, starts, counts, max(counts), self.device)
        rows = torch.tensor(done, device=self.device) if done else None
        return self._prefill(ids.to(self.device), batch, dflash, rows, check_commit=True)

    def _prefill(self, ids: torch.Tensor, batch: Batch, dflash: bool, rows: torch.Tensor | None,
                 check_commit: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        hidden, taps = self.target(ids, batch, self.target_cache, self.taps if dflash else ())
        if check_commit:  # a prefill keeps every token: a hybrid checks that on the host (not in a graph)
            self.target.commit(self.target_cache, batch, batch.num_tokens)
        if dflash:
            self.drafter.append_context(taps, batch, self.draft_cache)
        if rows is None:
            return None
        logits = self.target.lm_head.logits(hidden[rows, batch.num_tokens[rows] - 1])
        return logits, self.target.lm_head.greedy(logits)

    def context_bucket(self, x: StepInputs) -> int:
        """The bound on the keys a step's passes read (Batch.max_end): the context bucket above
        its longest row and block. Eager passes take it too, so that they launch what the
        graphs do."""
        need = x.max_start + self.block_size
        return next((c for c in self.context_buckets if c >= need), self.context_buckets[-1])

    def _batch(self, x: StepInputs, width: int) -> Batch:
        return Batch.full(x.slots, x.start, width, self.context_bucket(x))

    def ar(self, x: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """One target step -> (logits [n, V], greedy next token [n])."""
        hidden, _ = self.target(x.last_tokens[:, None], self._batch(x, 1), self.target_cache)
        logits = self._logits(hidden[:, 0])
        return logits, self.target.lm_head.greedy(logits)

    def draft(self, x: StepInputs, width: int | None = None) -> torch.Tensor:
        """One drafter pass over [bonus, MASK x (B-1)] per row -> the block [bs, B] with the
        proposals for the verify's `width` (default: all B) filled in at 1 .. width-1: the LM
        head and argmax run at those rows only (at load, a large share of the draft pass:
        benchmarks/draft_width.json; BENCHMARKS.md, "Engine: AR vs DFlash"), the block's other
        slots keep the mask token. The drafter still attends over the whole block, as it was
        trained to."""
        width = width or self.block_size
        batch = self._batch(x, self.block_size)
        block = torch.full((batch.size, batch.width), self.drafter.config.mask_token_id, dtype=torch.long,
                           device=x.last_tokens.device)
        block[:, 0] = x.last_tokens
        hidden = self.drafter(block, batch, self.draft_cache)
        block[:, 1:width] = self.drafter.propose(hidden[:, 1:width])
        return block

    def verify(self, x: StepInputs, block: torch.Tensor,
               width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One causal target pass over the block's first `width` tokens (default: all B; at
        most the width of the draft that filled the block) ->
        (logits [bs, width, V], accepted [bs], bonus [bs]), greedy; the drafter's context K/V
        of those rows is cached on the way.

        Rows past the accepted prefix land beyond the committed length in both caches and are
        overwritten by the next step before anything reads them (see kv_cache.py).
        """
        width = width or self.block_size
        batch = self._batch(x, width)
        # a block of other rows (e.g. a draft graph's, padded to its bucket) would index past them
        assert block.shape == (batch.size, self.block_size), f"block {tuple(block.shape)} for {batch.size} rows"
        block = block[:, :width].contiguous() if width < self.block_size else block
        hidden, tapped = self.target(block, batch, self.target_cache, self.taps)
        logits = self._logits(hidden)
        choice = self.target.lm_head.greedy(logits)
        accepted = accepted_length(block[:, 1:], choice[:, :-1])
        bonus = choice.gather(1, accepted[:, None])[:, 0]
        self.drafter.append_context(tapped, batch, self.draft_cache)
        return logits, accepted, bonus

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A decode pass's logits, which its sampled rows draw from after it."""
        return self.target.lm_head.logits(hidden)

    def capture_all(self) -> None:
        """Nothing to prepare for eager passes."""

    def commit(self, x: StepInputs, width: int, num_committed: list[int] | torch.Tensor) -> None:
        """After a pass of `width` tokens per row, keep the first num_committed[i] of row i
        (a host list, or a tensor on the device).
        Skipped for targets without recurrent state, so their decode step pays no copy for it,
        and after a one-token pass (an AR step), which a stateful target steps in place and
        keeps whole: building its batch would cost an AR step three launches for nothing."""
        if self.target.stateful and width > 1:
            self.target.commit(self.target_cache, self._batch(x, width), num_committed)


class GraphedPasses(DecodePasses):
    """The same passes captured as CUDA graphs, one per pass, batch-size bucket and context
    bucket (the decode passes).

    Captured lazily on first use of a bucket. All graphs share one memory pool; each keeps
    references to its static inputs and outputs, so no capture reuses another's buffers.
    The draft graph's output block is the verify graph's input (an oracle edits it in
    between). Outputs are views of static buffers, valid until the same graph replays.
    """

    def __init__(self, *args, max_batch_size: int):
        super().__init__(*args)
        self.buckets = [b for b in (1, 2, 4, 8, 16, 24, 32, 48) if b < max_batch_size] + [max_batch_size]
        self.scratch_slot = self.target_cache.k.shape[1] - 1
        self._pool = torch.cuda.graph_pool_handle()
        # (pass, bucket, verify or prefill width, else 0, context bucket) -> (graph, its static
        # input, its outputs)
        self._graphs: dict[tuple[str, int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = {}
        self._kept: dict[int, torch.Tensor] = {}  # per bucket: the commit graph's kept counts
        head = self.target.lm_head.weight
        positions = self.block_size if self.drafter is not None else 1  # a verify's, or an AR step's
        self._logit_rows = torch.empty(self.buckets[-1] * positions, head.shape[0], dtype=head.dtype,
                                       device=self.device)
        # A bucket wider than the target allows would read lengths on the host; for a stateful
        # target one no wider than the block would be taken for a verify (its state kept apart).
        widest = min(self.target.graph_prefill_tokens, self.target_cache.capacity)
        self.prefill_widths = [w for w in PREFILL_WIDTHS if self.block_size < w <= widest]
        # a prompt's slot, length and ids, for one async copy; reused once the previous
        # prefill's token has been read (a host sync), which every prefill's caller does
        self._prompt = torch.zeros(2 + max(PREFILL_WIDTHS), dtype=torch.long, pin_memory=True)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _staged(self, n: int) -> torch.Tensor:
        """The rows padded to the bucket on the host, so a replay needs one device copy."""
        return self._pad(self._host_rows(self.bucket(n)), n)

    def _pad(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """Rows n.. of `rows` [3, m] become padding: the scratch slot, position 0, token 0."""
        rows[0, n:] = self.scratch_slot
        rows[1:, n:] = 0
        return rows

    def capture_all(self, widths: tuple[int, ...] = ()) -> None:
        """Capture every bucket's graphs now (a capture costs about one eager pass), so no
        request waits for one later: per batch-size and context bucket the AR step, the
        verify (and a hybrid's commit) at the whole block and at each of `widths`, and the
        prefills (with and without the drafter's context). Padding rows write only the
        scratch slot."""
        for dflash in (False, True) if self.drafter is not None else (False,):
            for width in self.prefill_widths:
                self._prefill_graph(width, dflash)
        for size in self.buckets:
            for context in self.context_buckets:
                x = self._padding(size, max(context - self.block_size, 0))
                self.ar(x)
                if self.drafter is not None:
                    for width in sorted({self.block_size, *widths}):
                        self.verify(x, self.draft(x, width), width)
                        self.commit(x, width, [1] * size)

    def _padding(self, size: int, max_start: int = 0) -> StepInputs:
        """A bucket's worth of padding rows, in the context bucket of max_start."""
        return StepInputs(self._pad(torch.empty((3, size), dtype=torch.long, device=self.device), 0), size, max_start)

    def step_ms(self, widths: tuple[int, ...], reps: int = 10) -> dict[int, dict[int, float]]:
        """Per bucket and verify width: a DFlash step's pass time (draft + verify + commit) in
        ms, from replays on padding rows (they write only the scratch slot) whose blocks hold
        random tokens: identical rows would route every token of a MoE verify to the same few
        experts, and a wide verify would look as cheap as a narrow one. The shortest context
        bucket's graphs: where most steps run."""
        self.capture_all(widths)
        times: dict[int, dict[int, float]] = {}
        vocab = self.target.config.vocab_size
        for size in self.buckets:
            x = self._padding(size)
            times[size] = {}
            for width in widths:
                noise = random_block(self.draft(x, width), vocab).clone()  # drawn once: no generator in the timing
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    self.verify(x, self.draft(x, width).copy_(noise), width)
                    self.commit(x, width, [1] * size)
                end.record()
                end.synchronize()
                times[size][width] = start.elapsed_time(end) / reps
        return times

    def prefill(self, slots: list[int], starts: list[int], chunks: list[list[int]], dflash: bool,
                done: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        n = len(chunks[0])
        width = next((w for w in self.prefill_widths if w >= n), None)
        if done != [0] or len(chunks) > 1 or starts[0] != 0 or width is None:  # not one whole prompt
            return super().prefill(slots, starts, chunks, dflash, done)
        prompt = self._prompt[: 2 + width]
        prompt[0], prompt[1] = slots[0], n
        prompt[2: 2 + n] = torch.tensor(chunks[0])
        prompt[2 + n:] = 0  # padding: any token, its rows are never read
        return self._replay_graph(self._prefill_graph(width, dflash), prompt)

    def _prefill_graph(self, width: int, dflash: bool) -> tuple[str, int, int, int]:
        """The key of the prefill graph of one prompt padded to `width`, captured if new."""
        key = ("prefill+context" if dflash else "prefill", 1, width, width)
        if key not in self._graphs:
            prompt = torch.zeros(2 + width, dtype=torch.long, device=self.device)
            prompt[0], prompt[1] = self.scratch_slot, width
            self._graphs[key] = self._capture(prompt, lambda p: self._padded_prefill(p, dflash))
        return key

    def _padded_prefill(self, prompt: torch.Tensor, dflash: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """prompt [2 + W] on the device: the slot, the prompt's length n, then its ids padded to W."""
        width = prompt.shape[0] - 2
        slots, num_tokens = prompt[:1], prompt[1:2]
        batch = Batch.padded(slots, torch.zeros_like(slots), num_tokens, width, max_end=width)
        return self._prefill(prompt[2:][None], batch, dflash, torch.zeros_like(slots), check_commit=False)

    def ar(self, x: StepInputs):
        logits, token = self._replay("ar", x, lambda s: DecodePasses.ar(self, s))
        return logits[: x.size], token[: x.size]

    def draft(self, x: StepInputs, width: int | None = None) -> torch.Tensor:
        width = width or self.block_size  # a graph per verify width: its LM head's rows
        return self._replay("draft", x, lambda s: DecodePasses.draft(self, s, width), width)[: x.size]

    def verify(self, x: StepInputs, block: torch.Tensor, width: int | None = None):
        # The block is the output buffer of the draft graph of this width: verify reads it in place.
        width = width or self.block_size
        static_block = self._graphs[("draft", self.bucket(x.size), width, self.context_bucket(x))][2]
        assert block.data_ptr() == static_block.data_ptr(), f"verify expects the block of the width-{width} draft graph"
        logits, accepted, bonus = self._replay("verify", x, lambda s: DecodePasses.verify(self, s, static_block, width),
                                               width)
        return logits[: x.size], accepted[: x.size], bonus[: x.size]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Into one buffer that every decode graph shares: kept as each graph's own output they
        would cost a [bucket, width, vocabulary] tensor per graph. Sharing is safe in stream
        order: a step's sampled rows are drawn (queued) before the next graph is launched."""
        rows = hidden[..., 0].numel()
        return self.target.lm_head.logits(hidden, out=self._logit_rows[:rows].view(*hidden.shape[:-1], -1))

    def commit(self, x: StepInputs, width: int, num_committed: list[int] | torch.Tensor) -> None:
        """A hybrid target's commit after a verify (the kept tokens replayed over every linear
        layer in one kernel, the conv windows copied back, and the small ops that index them)
        runs as a graph too, one per verify width: eagerly, launching it cost more than its
        work at batch 1. The kept counts go to a static buffer; padding rows (on
        the scratch slot) keep whatever valid count it holds. Everything else commits eagerly
        (nothing, or an in-place AR step)."""
        if not self.target.stateful or width == 1:
            return super().commit(x, width, num_committed)
        b = self.bucket(x.size)
        if b not in self._kept:
            self._kept[b] = torch.ones(b, dtype=torch.long, device=self.device)
        kept = self._kept[b]
        kept[: x.size].copy_(torch.as_tensor(num_committed))
        self._replay("commit", x, lambda s: self.target.commit(self.target_cache, self._batch(s, width), kept), width)

    def _replay(self, name: str, x: StepInputs, fn, width: int = 0):
        key = (name, self.bucket(x.size), width, self.context_bucket(x))
        if key not in self._graphs:
            padding = self._padding(key[1], x.max_start)
            self._graphs[key] = self._capture(padding.packed,
                                              lambda packed: fn(StepInputs(packed, padding.size, padding.max_start)))
        return self._replay_graph(key, x.packed)  # padded to the bucket already (see inputs)

    def _replay_graph(self, key: tuple[str, int, int, int], inputs: torch.Tensor):
        graph, static_in, outputs = self._graphs[key]
        static_in.copy_(inputs, non_blocking=True)
        graph.replay()
        return outputs

    def _capture(self, static_in: torch.Tensor, fn):
        """The graph of fn(static_in), static_in's values those of padding (the scratch slot):
        the warm-up run and the capture write nothing a request owns."""
        dev = self.device
        # Warm up on a side stream (lazy initialisation, cuBLAS workspaces) before capturing.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            fn(static_in)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = fn(static_in)
        return graph, static_in, outputs


def random_block(block: torch.Tensor, vocab: int, seed: int = 0) -> torch.Tensor:
    """The draft block overwritten in place (the graphed verify reads the draft graph's
    buffer) with random tokens: padding rows, or a random drafter on noise, propose
    repetitive blocks whose tokens route to few experts; real blocks (text) do not."""
    gen = torch.Generator(device=block.device).manual_seed(seed)
    return block.copy_(torch.randint(0, vocab, block.shape, generator=gen, device=block.device, dtype=block.dtype))


def graphs_supported(target, device: torch.device) -> bool:
    """CUDA graphs need the CUDA attention kernel (the reference reads lengths on the host)
    and a target whose passes never read device values on the host (`graph_safe`)."""
    if device.type != "cuda" or not getattr(target, "graph_safe", False):
        return False
    if not ops.block_attention_kernel_supports(target.lm_head.weight.dtype, target.config.dims.head_dim):
        return False
    return plugins.load() is not None
