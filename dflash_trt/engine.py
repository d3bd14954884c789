"""The engine: continuous batching of many requests over one target (+ drafter).

Requests join (`add_request`) and leave (finish or `abort`) between steps. A step either
prefills newly admitted requests or advances every running one: by one token in AR mode,
or by one draft/verify round in DFlash mode. AR and DFlash share the models and caches,
so AR is the baseline that DFlash must reproduce.

With a prefill chunk C (`prefill_chunk`), prompts enter the caches at most C tokens per
step and every step also advances the running requests: a long prompt no longer stalls
them for its whole prefill, only for one chunk per step. A chunk continues the prompt from
its cached rows like a verify pass continues a sequence, so what the caches hold at the
end is what one whole pass writes (up to float rounding of the split).

AR runs one step ahead (`overlap`): step n+1 is queued on the device, fed by step n's
tokens there, before the host reads step n, so the host's bookkeeping no longer leaves the
device idle between steps; a step() returns the tokens of the step it read.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass
from typing import Iterable

import torch

from dflash_trt import fa3
from dflash_trt.errors import ConfigError, RequestError
from dflash_trt.graphs import DecodePasses, GraphedPasses, Readback, StepInputs, graphs_supported
from dflash_trt.models.dflash import DFlashDrafter
from dflash_trt.models.qwen3 import Qwen3ForCausalLM
from dflash_trt.sampling import SamplingParams, draw_keys, row_index, sampled_groups
from dflash_trt.sequence import RequestStats, Sequence
from dflash_trt.speculate import Drafted, OracleDrafts, speculative_step
from dflash_trt.verify_width import VerifyWidth, candidate_widths

MODES = ("ar", "dflash")
# the whole block every step; verify_width.py's choice; adaptive where CUDA graphs run, else full
VERIFY_WIDTHS = ("full", "adaptive", "auto")


@dataclass(frozen=True)
class GenerationResult:
    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats


@dataclass(frozen=True)
class StepEvent:
    """Tokens one request produced in one engine step (empty for an abort)."""

    seq: Sequence
    new_tokens: list[int]

    @property
    def finished(self) -> bool:
        return self.seq.is_finished


@dataclass(frozen=True)
class QueuedStep:
    """An AR step launched on the device, its tokens not yet read by the host."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] on the device: greedy, or drawn there for rows that sample
    readback: Readback  # the tokens on their way to the host


class Engine:
    def __init__(self, target: Qwen3ForCausalLM, drafter: DFlashDrafter | None = None, *,
                 max_batch_size: int = 8, max_seq_len: int = 4096, block_size: int = 0, mode: str | None = None,
                 oracle: OracleDrafts | None = None, cuda_graphs: bool = True, draft_window: int = 0,
                 prefill_chunk: int = 0, verify_width: str = "full", overlap: bool = True):
        self.target, self.drafter, self.oracle = target, drafter, oracle
        # AR: queue step n+1 before reading step n, so the host's work on step n hides
        # behind the device's on step n+1 (see _ar_step); DFlash: launch step n+1's draft
        # before reading step n's verify (speculative_step)
        self.overlap = overlap
        self.queued: QueuedStep | None = None
        self.queued_draft: Drafted | None = None
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        # block_size 0: the drafter's trained block size (a build may choose another)
        self.block_size = (block_size or drafter.config.block_size) if drafter else 1
        self.taps = drafter.config.target_layer_ids if drafter else ()
        self.mode = mode or ("dflash" if drafter else "ar")
        self._check_mode(self.mode)
        check_draft_window(draft_window, self.block_size)
        check_prefill_chunk(prefill_chunk)
        self.prefill_chunk = prefill_chunk
        # A window as long as the longest sequence never binds: the drafter keeps every row.
        self.draft_window = draft_window if drafter and draft_window < max_seq_len else 0
        capacity = max_seq_len + self.block_size  # a verify block may run past the last kept token
        # One slot more than requests: CUDA graphs point their padding rows at it. A target
        # with recurrent state is sized for cutting back the widest pass (the block).
        snapshots = {"num_snapshots": self.block_size} if target.stateful else {}
        window = {"window": self.draft_window, "block_size": self.block_size}
        self.device = target.lm_head.weight.device
        if self.device.type == "cuda":
            per_slot = sum(cache_bytes(m.new_cache(1, capacity, device="meta", **kw))
                           for m, kw in ((target, snapshots), (drafter, window)) if m is not None)
            free, total = torch.cuda.mem_get_info(self.device)
            # blocks PyTorch's allocator holds but no tensor uses are free for the caches too
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            check_caches_fit(per_slot, max_batch_size, max_seq_len, free, total)
        self.target_cache = target.new_cache(max_batch_size + 1, capacity, **snapshots)
        self.draft_cache = drafter.new_cache(max_batch_size + 1, capacity, **window) if drafter else None
        passes = (self.target, self.drafter, self.target_cache, self.draft_cache, self.taps, self.block_size)
        use_graphs = cuda_graphs and graphs_supported(target, self.device)
        self.passes = GraphedPasses(*passes, max_batch_size=max_batch_size) if use_graphs else DecodePasses(*passes)
        # ranks of a tensor-parallel target would time their own steps and choose apart
        one_rank = getattr(target, "tensor_parallel", 1) == 1
        check_verify_width(verify_width, graphed=use_graphs, one_rank=one_rank)
        auto = "adaptive" if use_graphs and one_rank else "full"
        self.verify_width = auto if verify_width == "auto" else verify_width
        # chooses each step's verify width from step times measured on the graphs (at warm-up
        # or the first step); tests may set one with step times of their own
        self.width_policy: VerifyWidth | None = None
        self.eos_token_ids = frozenset(target.config.eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: list[Sequence] = []  # chunked prefill: admitted, prompt partly cached
        self.free_slots = list(range(max_batch_size - 1, -1, -1))
        self._next_id = 0

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture the CUDA graphs of every batch-size bucket (no-op on the eager path), and
        time the verify widths an adaptive engine chooses from. Before any capture, where
        FlashAttention-3 is installed, each attention shape the graphs run takes the faster
        backend (fa3.py)."""
        if isinstance(self.passes, GraphedPasses):
            widths = [1] + ([] if self.drafter is None else [*candidate_widths(self.block_size), self.block_size])
            # a draft window's cache stores rows twice: FA3 would write one copy
            fa3.choose_for(self.target, self.passes.buckets, sorted(set(widths)), self.max_seq_len,
                           None if self.draft_window else self.drafter, self.block_size)
        self.passes.capture_all()
        self._start_width_policy()

    def _start_width_policy(self) -> None:
        if self.verify_width == "adaptive" and self.drafter is not None and self.width_policy is None:
            widths = candidate_widths(self.block_size)
            self.width_policy = VerifyWidth(self.block_size, self.passes.step_ms(widths))

    # -- requests -------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self._validate(prompt_ids, params)
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        seed = params.seed
        if seed is None:  # a fresh one for a sampling request (torch.seed() would reseed torch's own generator)
            seed = 0 if params.greedy else secrets.randbits(64)
        seq = Sequence(self._next_id, list(prompt_ids), params, frozenset(stop), seed)
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_ids) == 0:
            raise RequestError("the prompt is empty")
        vocab = self.target.config.vocab_size
        bad = [t for t in prompt_ids if not (0 <= t < vocab)]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the engine's "
                f"max_seq_len = {self.max_seq_len}"
            )

    def abort(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        seq.finish_reason = seq.finish_reason or "abort"
        self._release(seq)
        self._drop_dead_queued()

    def sibling(self, **changes) -> "Engine":
        """A new engine of this kind over the same models and block, `changes` (e.g. another
        max_batch_size or max_seq_len) applied; caches of its own."""
        settings = dict(max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len, block_size=self.block_size,
                        draft_window=self.draft_window, prefill_chunk=self.prefill_chunk,
                        verify_width=self.verify_width, overlap=self.overlap)
        return type(self)(self.target, self.drafter, **{**settings, **changes})

    def set_oracle(self, oracle: OracleDrafts | None) -> None:
        self.oracle = oracle

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    def will_prefill(self) -> bool:
        """Whether the next step runs a prefill pass (it may also decode, when chunked)."""
        return self.queued is None and self._prefill_due()

    def _prefill_due(self) -> bool:
        return bool(self.prefilling or (self.waiting and self.free_slots))

    def set_mode(self, mode: str) -> None:
        self._check_mode(mode)
        if mode != self.mode and self.has_work():
            raise RequestError("the mode can change only while the engine is idle")
        self.mode = mode

    def _check_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise RequestError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "dflash" and self.drafter is None:
            raise RequestError("DFlash mode needs a drafter; this engine has only a target")

    # -- stepping -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepEvent]:
        if self.queued is not None and self._prefill_due():
            # the queued AR step's tokens first: a prefill changes the batch, it runs next step
            events = self._read_queued()
        else:
            events = self._schedule()
        for event in events:
            if event.finished:
                self._release(event.seq)
        return events

    def _schedule(self) -> list[StepEvent]:
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            admitted.append(seq)
        if self.prefill_chunk:
            # one chunk of the waiting prompts, then a step of the requests already running
            self.prefilling += admitted
            decoding = list(self.running)
            events = self._prefill(*self._next_chunk()) if self.prefilling else []
            events += self._decode(decoding) if decoding else []
        elif admitted:
            lengths = [len(s.prompt_ids) for s in admitted]
            events = []
            for group in prefill_groups(lengths):
                events += self._prefill([admitted[i] for i in group], [lengths[i] for i in group])
        elif self.running:
            events = self._decode(self.running)
        else:
            events = []
        return events

    def _next_chunk(self) -> tuple[list[Sequence], list[int]]:
        """The prompts' next prefill_chunk tokens, first come first served."""
        seqs, counts, budget = [], [], self.prefill_chunk
        for seq in self.prefilling:
            n = min(len(seq.prompt_ids) - seq.num_cached, budget)
            if n == 0:
                break
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return seqs, counts

    def _prefill(self, seqs: list[Sequence], counts: list[int]) -> list[StepEvent]:
        """Cache the next counts[i] prompt tokens of each sequence (from its num_cached on); a
        sequence whose prompt is then all cached gets its first token and starts running."""
        starts = [s.num_cached for s in seqs]
        chunks = [s.prompt_ids[a: a + n] for s, a, n in zip(seqs, starts, counts)]
        done = [i for i, (s, a, n) in enumerate(zip(seqs, starts, counts)) if a + n == len(s.prompt_ids)]
        picked = self.passes.prefill([s.slot for s in seqs], starts, chunks, self.mode == "dflash", done)
        for s, n in zip(seqs, counts):
            s.num_cached += n
        if not done:
            return []
        logits, greedy = picked
        finished = [seqs[i] for i in done]
        tokens = self._tokens(greedy, logits, finished).tolist()
        for s in finished:
            if s in self.prefilling:
                self.prefilling.remove(s)
        self.running += finished
        return [StepEvent(s, s.emit([t])) for s, t in zip(finished, tokens)]

    def _decode(self, seqs: list[Sequence]) -> list[StepEvent]:
        if self.mode == "ar":
            return self._ar_step(seqs)
        self._start_width_policy()
        drafted, self.queued_draft = self.queued_draft, None
        if drafted is not None and not same_rows(drafted.seqs, seqs):
            drafted = None  # drafted for other rows: one finished, joined or was aborted since
        # A step verifies the width its draft proposed for, so a draft launched ahead needs the
        # next step's width now: chosen before this step's outcome is counted (a step's lag).
        width = drafted.width if drafted is not None else self._choose_width(len(seqs))
        ahead = self._draft_ahead(seqs, width)
        out = speculative_step(self.passes, seqs, self.oracle, width, drafted, ahead,
                               self._choose_width(len(seqs)) if ahead else None)
        self.queued_draft = out.next_draft
        if self.width_policy:
            self.width_policy.update(out.accepted, width)
        events = []
        for s, new, a in zip(seqs, out.tokens, out.accepted):
            s.stats.verify_steps += 1
            s.stats.verified_drafts += width - 1
            s.stats.acceptance_lengths.append(a + 1)
            s.num_cached += len(new)  # the committed rows: everything but the new last token
            events.append(StepEvent(s, s.emit(new)))
        return events

    def _choose_width(self, num_rows: int) -> int:
        return self.width_policy.choose(num_rows) if self.width_policy else self.block_size

    def _draft_ahead(self, seqs: list[Sequence], width: int) -> bool:
        """Whether this step may launch the next one's draft before it is read: rows (greedy
        or sampled: both outcomes are on the device) that all go on past this step, unless a
        prefill will be due (it changes the batch); a stop token ending a row still wastes
        the draft."""
        return (self.overlap and not self._prefill_due()
                and all(len(s.output_ids) + width < s.params.max_tokens for s in seqs))

    # -- AR, overlapped -------------------------------------------------------------------
    #
    # Step n's tokens feed step n+1 on the device (graphs.DecodePasses.next_inputs), so
    # step n+1 can be queued before the host reads step n. The host then reads step n,
    # checks stops and emits while the device computes step n+1: the device no longer
    # idles through that work. Rows may run one step for nothing: a row that stops at step
    # n (or is aborted) has been queued into step n+1; its result is dropped, and what it
    # wrote lies past the committed length or in a freed slot, which its next owner's
    # prefill overwrites (kv_cache.py; stream order puts that prefill after the step).

    def _ar_step(self, seqs: list[Sequence]) -> list[StepEvent]:
        step = self.queued or self._launch_ar(seqs, self.passes.inputs(seqs))
        self.queued = None
        ahead = self._rows_ahead(step)
        if ahead:
            row = {id(s): i for i, s in enumerate(step.seqs)}
            inputs = self.passes.next_inputs(ahead, [row[id(s)] for s in ahead], step.tokens)
            self.queued = self._launch_ar(ahead, inputs)
        events = self._emit_ar(step)
        self._drop_dead_queued()
        return events

    def _launch_ar(self, seqs: list[Sequence], inputs: StepInputs) -> QueuedStep:
        logits, greedy = self.passes.ar(inputs)
        tokens = self._tokens(greedy, logits, seqs)
        return QueuedStep(list(seqs), tokens, self.passes.read_later(tokens))

    def _rows_ahead(self, step: QueuedStep) -> list[Sequence]:
        """The sequences whose next step may be queued before `step` is read: none when the
        next step's batch is not this one's (a prefill joined or will be due); else those that
        still want a token."""
        live = [s for s in step.seqs if not s.is_finished]
        if not self.overlap or self.prefilling or set(live) != set(self.running):
            return []
        ending = any(len(s.output_ids) + 1 >= s.params.max_tokens for s in live)
        if self.waiting and (self.free_slots or ending):
            return []
        return [s for s in live if len(s.output_ids) + 1 < s.params.max_tokens]

    def _emit_ar(self, step: QueuedStep) -> list[StepEvent]:
        events = []
        for s, token in zip(step.seqs, step.readback.tolist()):
            if s.is_finished:  # stopped or aborted after this step was queued
                continue
            s.num_cached += 1
            events.append(StepEvent(s, s.emit([token])))
        return events

    def _read_queued(self) -> list[StepEvent]:
        step, self.queued = self.queued, None
        return self._emit_ar(step)

    def _drop_dead_queued(self) -> None:
        """A queued step whose rows all stopped or were aborted is waited for and dropped: it
        has nothing to emit, and its buffers are reused two launches on."""
        if self.queued is not None and all(s.is_finished for s in self.queued.seqs):
            self._read_queued()

    def _tokens(self, greedy: torch.Tensor, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Next token per row on the device: the greedy choice [bs], or for requests that
        sample a draw (from the row's own key) from the pass's logits [bs, V]. On the
        device, so a sampled step is queued ahead like a greedy one."""
        groups = sampled_groups([s.params for s in seqs])
        if not groups:
            return greedy
        tokens = greedy.clone()  # a graph's output buffer: the next replay overwrites it
        for rows in groups:
            head, params, index = self.target.lm_head, seqs[rows[0]].params, row_index(rows, tokens.device)
            dist = head.distribution(logits[index], params)
            tokens[index] = dist.draw(draw_keys([seqs[i] for i in rows], 1, tokens.device)[:, 0]).to(tokens.dtype)
        return tokens

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1

    # -- convenience ----------------------------------------------------------------------

    def generate(self, prompts: Iterable[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 mode: str | None = None) -> list[GenerationResult]:
        """Run prompts to completion (batched as the engine's slots allow); results in order."""
        prompts = list(prompts)
        params = params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if mode:
            self.set_mode(mode)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.has_work():
            self.step()
        return [GenerationResult(s.request_id, s.prompt_ids, s.output_ids, s.finish_reason, s.stats) for s in seqs]


def same_rows(a: list[Sequence], b: list[Sequence]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def check_draft_window(window: int, block_size: int) -> None:
    if window and window < block_size:
        raise ConfigError(f"draft_window_size = {window} must be 0 (no window) or at least the block size "
                          f"({block_size})")


def check_verify_width(verify_width: str, graphed: bool | None = None, one_rank: bool = True) -> None:
    """`graphed`: whether the engine's passes are CUDA graphs (None: not known yet, a build)."""
    if verify_width not in VERIFY_WIDTHS:
        raise ConfigError(f"verify_width must be one of {', '.join(VERIFY_WIDTHS)}, got {verify_width!r}")
    if verify_width == "adaptive" and not one_rank:
        raise ConfigError("verify_width = adaptive with tensor parallelism is not supported yet (every rank would "
                          "have to choose the same width)")
    if verify_width == "adaptive" and graphed is False:
        raise ConfigError("verify_width = 'adaptive' needs CUDA graphs (a CUDA device with the plugins built): it "
                          "chooses from step times measured on them")


# A prefill pass reads every weight once, however many tokens it carries, and pads every
# prompt to its longest. Up to a few hundred tokens the weight read, not the tokens' compute,
# sets a pass's time, so this is what one more pass costs in padded tokens: prompts of very
# different lengths admitted together prefill in several passes only where the padding they
# save is worth more (BENCHMARKS.md, "Prefill", a burst).
PREFILL_PASS_TOKENS = 256


def prefill_groups(lengths: list[int], pass_tokens: int = PREFILL_PASS_TOKENS) -> list[list[int]]:
    """The prompts (indices into `lengths`) of each prefill pass: in order of length, the
    split that minimises the padded tokens (a pass as long as its longest prompt) plus
    pass_tokens per pass."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    cost, cut = [0] * (len(order) + 1), [0] * (len(order) + 1)  # of the first j prompts
    for j in range(1, len(order) + 1):
        longest = lengths[order[j - 1]]
        cost[j], cut[j] = min((cost[i] + longest * (j - i) + pass_tokens, i) for i in range(j))
    groups, j = [], len(order)
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def check_prefill_chunk(chunk: int) -> None:
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
        raise ConfigError(f"prefill_chunk_size = {chunk!r} must be 0 (a prompt in one pass) or an int > 0")


# -- memory -------------------------------------------------------------------------------

GiB = 1 << 30


def cache_bytes(cache) -> int:
    """Bytes of a cache's tensors (a "meta" cache counts without allocating)."""
    return sum(t.numel() * t.element_size() for t in vars(cache).values() if isinstance(t, torch.Tensor))


def check_caches_fit(per_slot: int, max_batch_size: int, max_seq_len: int, free: int, total: int) -> None:
    """Refuse, naming the knobs, caches that would not fit next to the loaded weights.

    The caches take `per_slot` bytes for each of max_batch_size + 1 slots (one is the CUDA
    graphs' scratch slot). Beyond them a pass needs its activations and the graphs their pool:
    a reserve of 5% of the GPU, at least 1 GiB, is kept for those (a rough bound, as vLLM's
    gpu_memory_utilization is; an out-of-memory error past it is still possible).
    """
    reserve = max(GiB, total // 20)
    need = per_slot * (max_batch_size + 1)
    if need + reserve <= free:
        return
    fit = max(0, (free - reserve) // per_slot - 1)
    advice = (f"lower max_batch_size (at most {fit} fit) or max_input_len + max_output_len" if fit else
              "not even one request fits: lower max_input_len + max_output_len or use a larger GPU")
    raise ConfigError(
        f"the KV caches for max_batch_size = {max_batch_size} requests of up to max_seq_len = {max_seq_len} "
        f"tokens need {need / GiB:.1f} GiB ({per_slot / GiB:.2f} GiB per request, Qwen3.5 linear-attention state "
        f"and rollback buffers included), but only {free / GiB:.1f} GiB of the GPU are free after the weights and "
        f"{reserve / GiB:.1f} GiB are kept for activations; {advice}")
