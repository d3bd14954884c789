"""The serving logic behind the Triton models, without Triton: detokenizer, request checks,
preprocessing, and the engine thread (batching, streaming, stops, cancellation, failures)."""

import random
import re
import threading
import time

import numpy as np
import pytest

from dflash_trt.loading import load_pair
from dflash_trt.sampling import SamplingParams
from dflash_trt.sequence import RequestStats
from dflash_trt.serving import protocol as p
from dflash_trt.serving.metrics import TritonMetrics
from dflash_trt.serving.text import IncrementalDetokenizer, Preprocessor, max_text_bytes, postprocess
from dflash_trt.serving.worker import Chunk, EngineWorker, perf_metrics, stop_cut
from dflash_trt.tokenizer import Tokenizer

LIMITS = p.Limits(max_input_len=64, max_output_len=48)
MULTIBYTE_TEXTS = ["héllo wörld", "你好，世界！", "emoji 😀🎉 end", "mixed: ü 中 🙂 ok", "😀"]


@pytest.fixture(scope="module")
def pair(make_pair):
    return make_pair(block_size=4)  # the default spec has a real Qwen tokenizer of 1000 tokens


@pytest.fixture(scope="module")
def tokenizer(pair):
    return Tokenizer.from_dir(pair.target)


def new_engine(pair, **kwargs):
    return load_pair(pair.target, pair.drafter, max_seq_len=LIMITS.max_input_len + LIMITS.max_output_len, **kwargs)


# -- incremental detokenizer ------------------------------------------------------------------


def stream(tokenizer, ids, sizes):
    detok = IncrementalDetokenizer(tokenizer.decode)
    chunks, i = [], 0
    for size in sizes:
        chunks.append(detok.push(ids[i: i + size]))
        i += size
    return chunks + [detok.flush()]


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_streamed_multibyte_text_concatenates_to_the_full_text_and_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    # The 1000-token vocabulary spells these characters with several byte tokens, so naive
    # per-token decoding would split them: this is what the detokenizer must avoid.
    assert "\ufffd" in "".join(tokenizer.decode([i]) for i in ids)
    chunks = stream(tokenizer, ids, [1] * len(ids))
    assert "".join(chunks) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)


def test_a_character_split_over_byte_tokens_is_held_back_until_it_is_complete(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) == 4  # one token per UTF-8 byte in this vocabulary
    assert stream(tokenizer, ids, [1, 1, 1, 1]) == ["", "", "", "😀", ""]


def test_an_incomplete_character_at_the_end_is_flushed_as_decode_renders_it(tokenizer):
    ids = tokenizer.encode("ok😀")[:-2]
    chunks = stream(tokenizer, ids, [1] * len(ids))
    assert chunks[-1] == "\ufffd" and "".join(chunks) == tokenizer.decode(ids)


def test_random_token_streams_concatenate_to_the_decode_of_all_tokens(tokenizer):
    # Random ids include broken UTF-8 (lone continuation bytes, truncated sequences).
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        sizes = [rng.randint(1, 4) for _ in range(len(ids))]
        assert "".join(stream(tokenizer, ids, sizes)) == tokenizer.decode(ids)


# -- stop words, word lists, metrics ----------------------------------------------------------


@pytest.mark.parametrize("output, new, words, keep", [
    ([], [1, 2, 3], (), None),
    ([], [1, 2, 3], ((2,),), 2),
    ([5], [1, 2, 3], ((5, 1),), 1),  # a stop word that started in an earlier step
    ([9, 9], [4, 2, 3], ((9, 9, 4, 2),), 2),
    ([], [1, 2, 3], ((3,), (1, 2)), 2),  # the first completed word wins, whichever it is
    ([], [1, 2, 3], ((2, 1),), None),
])
def test_stop_cut_keeps_the_output_up_to_the_first_completed_stop_word(output, new, words, keep):
    assert stop_cut(output, new, words) == keep


@pytest.mark.parametrize("words", [[], [[7]], [[1, 2], [3], [4, 5, 6]]])
def test_word_lists_round_trip_through_the_tensorrt_llm_format(words):
    packed = p.pack_word_list(words)
    assert packed.shape == (2, sum(map(len, words))) and packed.dtype == np.int32
    assert p.unpack_word_list(packed) == tuple(map(tuple, words))


def test_perf_metrics_count_drafted_and_accepted_tokens():
    # three verify steps of 8, 4 and 8 tokens (an adaptive width): 7 + 3 + 7 drafts verified
    stats = RequestStats(prompt_tokens=5, verify_steps=3, verified_drafts=17, acceptance_lengths=[1, 4, 8])
    assert perf_metrics(stats, block_size=8, num_output_tokens=13) == {
        p.ACCEPTANCE_RATE: 10 / 17, p.TOTAL_ACCEPTED_DRAFT_TOKENS: 10, p.TOTAL_DRAFT_TOKENS: 17,
        p.NUM_INPUT_TOKENS: 5, p.NUM_OUTPUT_TOKENS: 13, p.MEAN_ACCEPTANCE_LENGTH: 13 / 3,
    }
    assert stats.mean_verify_width == 1 + 17 / 3


def test_postprocess_maps_text_and_present_metrics_onto_its_outputs():
    arrays = Chunk("hé", True, {p.NUM_OUTPUT_TOKENS: 3}).to_arrays()
    out = postprocess({name: a[0] for name, a in arrays.items()})
    assert set(out) == {p.OUTPUT, "NUM_OUTPUT_TOKENS"}
    assert out[p.OUTPUT][0, 0].decode() == "hé" and out["NUM_OUTPUT_TOKENS"].dtype == np.int32


# -- request checks ---------------------------------------------------------------------------


def arrays_of(**values):
    """Request tensors with the batch dimension, from plain values."""
    out = {}
    for name, value in values.items():
        a = np.asarray(value)
        out[name] = a[np.newaxis] if a.ndim else a.reshape(1, 1)
    return out


def read(specs, arrays):
    return p.read_inputs(arrays.get, specs)


QUERY_ERRORS = {
    "missing text_input": (dict(REQUEST_OUTPUT_LEN=np.int32(4)), "missing required input 'QUERY'"),
    "empty text_input": (dict(QUERY=np.array([b""], object), REQUEST_OUTPUT_LEN=np.int32(4)), "'text_input' is empty"),
    "max_tokens as FP32": (dict(QUERY=np.array([b"hi"], object), REQUEST_OUTPUT_LEN=np.float32(4)),
                           "input 'REQUEST_OUTPUT_LEN' must be INT32, got float32"),
    "bad words": (dict(QUERY=np.array([b"hi"], object), REQUEST_OUTPUT_LEN=np.int32(4),
                       BAD_WORDS_DICT=np.array([b"x"], object)), "'bad_words' is not supported"),
    "invalid UTF-8": (dict(QUERY=np.array([b"\xff"], object), REQUEST_OUTPUT_LEN=np.int32(4)), "not valid UTF-8"),
}


@pytest.mark.parametrize("case", QUERY_ERRORS)
def test_bad_queries_are_rejected_with_a_clear_message(case):
    values, message = QUERY_ERRORS[case]
    with pytest.raises(p.RequestValidationError, match=message):
        p.Query.from_arrays(read(p.PREPROCESSING_INPUTS, arrays_of(**values))).validate()


def test_a_batch_of_several_prompts_is_rejected():
    arrays = {"QUERY": np.array([[b"a"], [b"b"]], object), "REQUEST_OUTPUT_LEN": np.array([[4], [4]], np.int32)}
    with pytest.raises(p.RequestValidationError, match="batch size 2; send one prompt per request"):
        read(p.PREPROCESSING_INPUTS, arrays)


def engine_request(**overrides):
    values = dict(INPUT_ID=np.array([1, 2, 3], np.int32), REQUEST_INPUT_LEN=np.int32(3),
                  REQUEST_OUTPUT_LEN=np.int32(8))
    values.update(overrides)
    return p.Request.from_arrays(read(p.DFLASH_INPUTS, arrays_of(**values)))


REQUEST_ERRORS = {
    "empty prompt": (dict(INPUT_ID=np.array([], np.int32), REQUEST_INPUT_LEN=np.int32(0)), "the prompt is empty"),
    "prompt too long": (dict(INPUT_ID=np.ones(65, np.int32), REQUEST_INPUT_LEN=np.int32(65)),
                        "the prompt is 65 tokens, more than this engine's max_input_len = 64"),
    "length beyond ids": (dict(REQUEST_INPUT_LEN=np.int32(4)), "'REQUEST_INPUT_LEN' is 4, but 'INPUT_ID' holds 3"),
    "id outside vocab": (dict(INPUT_ID=np.array([1, 5000], np.int32), REQUEST_INPUT_LEN=np.int32(2)),
                         "prompt token id 5000 is outside the vocabulary"),
    "max_tokens 0": (dict(REQUEST_OUTPUT_LEN=np.int32(0)), "'max_tokens' must be an int > 0, got 0"),
    "max_tokens too large": (dict(REQUEST_OUTPUT_LEN=np.int32(49)),
                             "'max_tokens' is 49, more than this engine's max_output_len = 48"),
    "negative temperature": (dict(TEMPERATURE=np.float32(-1)), "'temperature' must be a number >= 0"),
    "nan temperature": (dict(TEMPERATURE=np.float32("nan")), "'temperature' must be a number >= 0"),
    "negative top_k": (dict(TOP_K=np.int32(-2)), "'top_k' must be an int >= 0, got -2"),
    "top_p 0": (dict(TOP_P=np.float32(0)), r"'top_p' must be in \(0, 1\]"),
    "end_id outside vocab": (dict(END_ID=np.int32(5000)), "'end_id' 5000 is outside the vocabulary"),
    "temperature as FP64": (dict(TEMPERATURE=np.float64(1)), "input 'TEMPERATURE' must be FP32, got float64"),
}


@pytest.mark.parametrize("case", REQUEST_ERRORS)
def test_bad_engine_requests_get_a_client_error_naming_the_value(case, worker):
    """Whichever layer owns the field (protocol, SamplingParams, the engine), the client gets
    one error with the message, flagged as its own fault, and the worker serves on."""
    values, message = REQUEST_ERRORS[case]
    sink = ClientErrorSink()
    try:
        worker.submit(engine_request(**values), sink)
    except p.RequestValidationError as e:  # refused in the caller's thread
        errors = [(str(e), True)]
    else:  # refused by the engine thread
        errors = sink.wait().failures
    assert len(errors) == 1 and errors[0][1], errors
    assert re.search(message, errors[0][0]), errors
    assert worker.alive


def test_an_engine_request_reads_every_setting():
    request = engine_request(STREAM=True, TEMPERATURE=np.float32(0.5), TOP_K=np.int32(3), TOP_P=np.float32(0.9),
                             SEED=np.uint64(7), END_ID=np.int32(9), EXCLUDE_INPUT_IN_OUTPUT=True,
                             RETURN_PERF_METRICS=True, STOP_WORDS_IDS=p.pack_word_list([[4, 5], [6]]))
    assert request == p.Request(prompt_ids=(1, 2, 3), max_tokens=8, stream=True, temperature=0.5, top_k=3,
                                top_p=pytest.approx(0.9), seed=7, end_id=9, stop_words=((4, 5), (6,)),
                                exclude_input_in_output=True, return_perf_metrics=True)
    assert engine_request(END_ID=np.int32(p.NO_END_ID)).end_id is None


# -- preprocessing ----------------------------------------------------------------------------


def preprocess(tokenizer, **values):
    arrays = read(p.PREPROCESSING_INPUTS, arrays_of(**values))
    return Preprocessor(tokenizer, max_text_bytes=4096)(arrays)


def test_preprocessing_tokenizes_the_prompt_and_the_stop_words(tokenizer):
    out = preprocess(tokenizer, QUERY=np.array(["héllo".encode()], object), REQUEST_OUTPUT_LEN=np.int32(5),
                     STOP_WORDS_DICT=np.array([b" the", b"", b"x"], object))
    ids = tokenizer.encode("héllo")
    assert out[p.INPUT_ID].tolist() == [ids] and out[p.REQUEST_INPUT_LEN].tolist() == [[len(ids)]]
    assert out[p.REQUEST_OUTPUT_LEN].tolist() == [[5]]
    stop_words = (tuple(tokenizer.encode(" the")), tuple(tokenizer.encode("x")))  # the empty word is dropped
    assert p.unpack_word_list(out[p.STOP_WORDS_IDS][0]) == stop_words
    assert out[p.BAD_WORDS_IDS].shape == (1, 2, 0)
    assert out[p.OUT_END_ID].tolist() == [[p.NO_END_ID]] and out[p.OUT_PAD_ID].tolist() == [[tokenizer.pad_token_id]]
    for spec in p.PREPROCESSING_OUTPUTS:  # what the dflash model will check
        assert out[spec.name].dtype == p.NUMPY_DTYPES[spec.dtype] and out[spec.name].ndim == len(spec.dims) + 1


def test_a_text_over_the_byte_limit_is_refused_before_it_is_tokenized(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "encode", lambda text: pytest.fail("tokenized an oversized text"))
    for name in ("QUERY", "STOP_WORDS_DICT"):
        values = dict(QUERY=np.array([b"hi"], object), REQUEST_OUTPUT_LEN=np.int32(5))
        values[name] = np.array([b"x" * 4097], object)
        client_name = {"QUERY": "text_input", "STOP_WORDS_DICT": "stop_words"}[name]
        with pytest.raises(p.RequestValidationError, match=f"'{client_name}' is 4,097 bytes, more than this engine"):
            preprocess(tokenizer, **values)


def test_the_derived_byte_limit_admits_every_text_of_max_input_len_tokens(tokenizer):
    # the longest token repeated: the most bytes max_input_len tokens can spell
    longest = max(tokenizer.decode([i]).encode() for i in range(tokenizer.vocab_size) if "\ufffd" not in
                  tokenizer.decode([i]))
    limit = max_text_bytes(LIMITS.max_input_len, tokenizer)
    assert len(longest) * LIMITS.max_input_len <= limit <= 3 * tokenizer.max_token_bytes * LIMITS.max_input_len


def test_preprocessing_applies_the_chat_template_when_asked(tokenizer):
    out = preprocess(tokenizer, QUERY=np.array([b"hi"], object), REQUEST_OUTPUT_LEN=np.int32(5), CHAT=True,
                     END_ID=np.int32(42))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert out[p.INPUT_ID][0].tolist() == tokenizer.encode(text) and out[p.OUT_END_ID].tolist() == [[42]]


# -- the engine thread ------------------------------------------------------------------------


class RecordingSink:
    """Collects what the worker sends for one request; can pretend its client cancelled."""

    def __init__(self, cancel_after_chunks=None):
        self.chunks, self.errors, self.cancelled = [], [], False
        self.cancel_after_chunks = cancel_after_chunks
        self.done = threading.Event()

    def send(self, chunk):
        self.chunks.append(chunk)
        if chunk.final:
            self.done.set()

    def fail(self, message, client_error=False):
        self.errors.append(message)
        self.done.set()

    def cancel(self):
        self.cancelled = True
        self.done.set()

    def is_cancelled(self):
        return self.cancel_after_chunks is not None and len(self.chunks) >= self.cancel_after_chunks

    @property
    def text(self):
        return "".join(c.text for c in self.chunks)

    def wait(self):
        assert self.done.wait(60), "the worker never finished this request"
        return self


class ClientErrorSink(RecordingSink):
    """Also records whether each failure was flagged as the client's fault."""

    def __init__(self):
        super().__init__()
        self.failures = []

    def fail(self, message, client_error=False):
        self.failures.append((message, client_error))
        super().fail(message, client_error)


# With this tiny pair, "def f(x):" and "é" make the model generate multi-byte characters.
PROMPTS = ["Hello", "你好，世界", "def f(x):", "Ünïcödé 😀", "a b c", "The", "é"]


@pytest.fixture(scope="module")
def reference(pair, tokenizer):
    """Greedy AR output ids per prompt from a separate in-process engine (the end token dropped)."""
    engine = new_engine(pair)
    params = SamplingParams(max_tokens=LIMITS.max_output_len, stop_token_ids=tuple(tokenizer.stop_token_ids))
    results = engine.generate([tokenizer.encode(prompt) for prompt in PROMPTS], params, mode="ar")
    return {prompt: r.token_ids[:-1] if r.finish_reason == "stop" else r.token_ids
            for prompt, r in zip(PROMPTS, results)}


@pytest.fixture
def worker(pair, tokenizer):
    w = EngineWorker(new_engine(pair, max_batch_size=3), tokenizer, LIMITS)
    yield w
    w.stop()
    assert not w.alive


def submit(worker, tokenizer, prompt, sink=None, **fields):
    sink = sink or RecordingSink()
    fields = {"max_tokens": LIMITS.max_output_len, "exclude_input_in_output": True, **fields}
    worker.submit(p.Request(prompt_ids=tuple(tokenizer.encode(prompt)), **fields), sink)
    return sink


def test_concurrent_requests_get_the_greedy_text_engine_generate_gives(worker, tokenizer, reference):
    # More requests than the engine's 3 slots, from several threads, half of them streamed.
    sinks = {}

    def client(i, prompt):
        sinks[i] = submit(worker, tokenizer, prompt, stream=bool(i % 2)).wait()

    threads = [threading.Thread(target=client, args=(i, pr)) for i, pr in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(PROMPTS):
        sink = sinks[i]
        assert not sink.errors and sink.chunks[-1].final and not any(c.final for c in sink.chunks[:-1])
        assert sink.text == tokenizer.decode(reference[prompt]), prompt
        assert len(sink.chunks) == 1 or i % 2  # unstreamed: exactly one response
    assert worker.num_active == 0 and sorted(worker.engine.free_slots) == [0, 1, 2]


def test_streamed_multibyte_output_concatenates_to_the_full_text(worker, tokenizer, reference):
    streamed = [submit(worker, tokenizer, prompt, stream=True) for prompt in PROMPTS]
    for prompt, sink in zip(PROMPTS, streamed):
        assert sink.wait().text == tokenizer.decode(reference[prompt]), prompt
    # The outputs hold multi-byte characters spelled by several tokens (per-token decoding
    # would have split them), so the equality above covers characters split across steps.
    multibyte = [c for ids in reference.values() for c in tokenizer.decode(ids) if ord(c) > 127 and c != "\ufffd"]
    per_token = "".join(tokenizer.decode([i]) for ids in reference.values() for i in ids)
    assert any(c not in per_token for c in multibyte), "no split multi-byte character was generated"


def test_the_prompt_is_part_of_the_unstreamed_text_unless_excluded(worker, tokenizer, reference):
    sink = submit(worker, tokenizer, "Hello", exclude_input_in_output=False).wait()
    assert sink.text == "Hello" + tokenizer.decode(reference["Hello"])
    sink = submit(worker, tokenizer, "Hello", exclude_input_in_output=False, stream=True).wait()
    assert sink.text == tokenizer.decode(reference["Hello"])  # streams never repeat the prompt


def test_a_stop_word_ends_generation_and_stays_in_the_output(worker, tokenizer, reference):
    ids = reference["def f(x):"]
    word = tuple(ids[5:7])
    assert all(tuple(ids[i:i + 2]) != word for i in range(5))  # its first occurrence
    sink = submit(worker, tokenizer, "def f(x):", stop_words=(word, (99999,))).wait()
    assert sink.text == tokenizer.decode(ids[:7])


def test_end_id_ends_generation_and_is_left_out_of_the_output(worker, tokenizer, reference):
    ids = reference["The"]
    end = ids[4]
    first = ids.index(end)
    sink = submit(worker, tokenizer, "The", end_id=end, return_perf_metrics=True).wait()
    assert sink.text == tokenizer.decode(ids[:first])
    assert sink.chunks[-1].metrics[p.NUM_OUTPUT_TOKENS] == first


def test_perf_metrics_come_with_every_response_when_asked(worker, tokenizer, reference):
    sink = submit(worker, tokenizer, "a b c", stream=True, return_perf_metrics=True).wait()
    assert all(c.metrics is not None for c in sink.chunks)
    final = sink.chunks[-1].metrics
    assert final[p.NUM_INPUT_TOKENS] == len(tokenizer.encode("a b c"))
    assert final[p.NUM_OUTPUT_TOKENS] == len(reference["a b c"])
    assert final[p.TOTAL_DRAFT_TOKENS] > 0 and final[p.TOTAL_DRAFT_TOKENS] % 3 == 0  # block size 4: 3 drafts a step
    assert 0 <= final[p.ACCEPTANCE_RATE] <= 1
    assert submit(worker, tokenizer, "a b c").wait().chunks[-1].metrics is None


def test_a_cancelled_request_is_aborted_and_frees_its_slot(worker, tokenizer, reference):
    cancelled = submit(worker, tokenizer, "Hello", RecordingSink(cancel_after_chunks=2), stream=True).wait()
    assert cancelled.cancelled and not cancelled.errors
    assert 2 <= len(cancelled.chunks) < len(reference["Hello"]) and not any(c.final for c in cancelled.chunks)
    assert worker.num_active == 0 and sorted(worker.engine.free_slots) == [0, 1, 2]
    assert submit(worker, tokenizer, "Hello").wait().text == tokenizer.decode(reference["Hello"])


def test_a_failing_step_fails_the_requests_in_it_and_the_worker_serves_on(worker, tokenizer, reference):
    real_step, calls = worker.engine.step, []

    def step_failing_once():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    worker.engine.step = step_failing_once
    failed = [submit(worker, tokenizer, prompt) for prompt in ("Hello", "The")]
    for sink in failed:
        assert sink.wait().errors == ["generation failed: RuntimeError('simulated kernel failure')"]
    assert worker.alive and sorted(worker.engine.free_slots) == [0, 1, 2]
    assert submit(worker, tokenizer, "The").wait().text == tokenizer.decode(reference["The"])


class GoneSink(RecordingSink):
    """A client that went away after its second response: sending raises."""

    def send(self, chunk):
        if len(self.chunks) == 2:
            self.done.set()
            raise ConnectionError("the client is gone")
        super().send(chunk)


def test_a_request_whose_responses_cannot_be_sent_is_aborted_and_others_are_unaffected(worker, tokenizer,
                                                                                          reference):
    real_abort, aborted = worker.engine.abort, []
    worker.engine.abort = lambda seq: (aborted.append(seq.request_id), real_abort(seq))
    gone = submit(worker, tokenizer, "Hello", GoneSink(), stream=True)
    other = submit(worker, tokenizer, "The", stream=True)
    assert other.wait().text == tokenizer.decode(reference["The"])
    gone.wait()
    deadline = time.monotonic() + 10
    while worker.num_active and time.monotonic() < deadline:  # the abort reaches the engine thread
        time.sleep(0.01)
    assert aborted == [0], "the gone client's request (the first one) is aborted, not run to its end"
    assert worker.num_active == 0 and sorted(worker.engine.free_slots) == [0, 1, 2]
    assert len(gone.chunks) == 2 and not any(c.final for c in gone.chunks)
    assert len(reference["Hello"]) > 8, "the request must outlive its client for this test to mean anything"


def test_a_bad_request_is_refused_at_submit_and_others_are_unaffected(worker, tokenizer, reference):
    with pytest.raises(p.RequestValidationError, match="max_output_len = 48"):
        submit(worker, tokenizer, "Hello", max_tokens=49)
    assert submit(worker, tokenizer, "Hello").wait().text == tokenizer.decode(reference["Hello"])


def test_stopping_the_worker_fails_requests_still_in_flight(pair, tokenizer):
    w = EngineWorker(new_engine(pair, max_batch_size=1), tokenizer, LIMITS)
    sinks = [submit(w, tokenizer, prompt, max_tokens=48) for prompt in PROMPTS[:3]]
    w.stop()
    assert not w.alive
    for sink in sinks:
        sink.wait()
        assert sink.errors == ["the server is shutting down"] or sink.chunks[-1].final
    with pytest.raises(p.RequestValidationError, match="shutting down"):
        submit(w, tokenizer, "Hello")


# -- metrics ------------------------------------------------------------------------------------


class FakeMetricFamily:
    """triton_python_backend_utils.MetricFamily's surface, recording into `series`."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind

    def Metric(self, labels, buckets=None):  # noqa: N802 (pb_utils' name)
        self.metric = FakeMetric(labels, buckets)
        FakeMetricFamily.series[self.name] = self.metric
        return self.metric

    def __del__(self):  # as in Triton: a deleted family's metrics refuse every operation
        self.metric.family_deleted = True


class FakeMetric:
    def __init__(self, labels, buckets):
        self.labels, self.buckets, self.value, self.observed = labels, buckets, 0, []
        self.family_deleted = False

    def increment(self, value):
        assert value >= 0 and not self.family_deleted
        self.value += value

    def set(self, value):
        assert not self.family_deleted
        self.value = value

    def observe(self, value):
        assert not self.family_deleted
        self.observed.append(value)


def test_metrics_add_up_to_the_responses_own_perf_metrics(pair, tokenizer, monkeypatch):
    monkeypatch.setattr(FakeMetricFamily, "series", {}, raising=False)
    pb_utils = type("pb_utils", (), {"MetricFamily": FakeMetricFamily})
    engine = new_engine(pair, max_batch_size=3)
    metrics = TritonMetrics(pb_utils, {"model": "dflash", "version": "1"}, engine.block_size)
    worker = EngineWorker(engine, tokenizer, LIMITS, metrics=metrics)
    try:
        sinks = [submit(worker, tokenizer, prompt, max_tokens=12, stream=bool(i % 2), return_perf_metrics=True)
                 for i, prompt in enumerate(PROMPTS)]
        finals = [sink.wait().chunks[-1].metrics for sink in sinks]
    finally:
        worker.stop()  # the sender drains its queue: every update is recorded
    series = FakeMetricFamily.series
    assert series["dflash_output_tokens_total"].value == sum(m[p.NUM_OUTPUT_TOKENS] for m in finals)
    assert series["dflash_draft_tokens_total"].value == sum(m[p.TOTAL_DRAFT_TOKENS] for m in finals) > 0
    assert series["dflash_accepted_draft_tokens_total"].value == sum(m[p.TOTAL_ACCEPTED_DRAFT_TOKENS] for m in finals)
    steps = series["dflash_verify_steps_total"].value
    assert steps * (engine.block_size - 1) == series["dflash_draft_tokens_total"].value
    observed = series["dflash_acceptance_length"].observed
    assert len(observed) == steps and sum(observed) - steps == series["dflash_accepted_draft_tokens_total"].value
    assert series["dflash_acceptance_length"].buckets == [float(b) for b in range(1, engine.block_size + 1)]
    assert [series[f"dflash_{g}"].value for g in ("running_requests", "waiting_requests", "kv_slots_used")] == [0, 0, 0]
    assert all(m.labels == {"model": "dflash", "version": "1"} for m in series.values())
