"""What crosses the Triton boundary: tensor names, dtypes and dims, defined once.

Three naming tiers, as in the Triton TensorRT-LLM backend's `inflight_batcher_llm` repository:
snake_case at the client-facing `ensemble` (its exact names, so existing tritonclient scripts
and the `/v2/models/ensemble/generate` endpoints work unchanged), UPPER_SNAKE inside the
`preprocessing`, `dflash` and `postprocessing` models, and `_`-prefixed ensemble
intermediates. `repository.py` renders the config.pbtxt tensor blocks and the ensemble wiring
from these tables, and the `model.py` adapters read and write tensors by these names.

Every model has `max_batch_size > 0`, so a tensor of dims [1] arrives as shape [batch, 1];
dflash-trt serves one prompt per request (batch 1), see `Request.from_arrays`.

`Query` (what preprocessing reads) and `Request` (what the dflash model reads) are the plain
Python views of a request; both raise `RequestValidationError` with a message naming the
tensor and the bad value. This module imports neither torch nor Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from dflash_trt.errors import RequestError

# -- dtypes ---------------------------------------------------------------------------------

STRING, BOOL, INT32, UINT64, FP32 = "STRING", "BOOL", "INT32", "UINT64", "FP32"
NUMPY_DTYPES = {STRING: np.object_, BOOL: np.bool_, INT32: np.int32, UINT64: np.uint64, FP32: np.float32}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton dtype without the TYPE_ prefix
    dims: tuple[int, ...] = (1,)  # without the batch dimension
    optional: bool = True


# -- model names ------------------------------------------------------------------------------

ENSEMBLE, PREPROCESSING, DFLASH, POSTPROCESSING = "ensemble", "preprocessing", "dflash", "postprocessing"
# Triton 2.51 treats an ensemble with a decoupled step as decoupled and refuses it on HTTP
# /infer and gRPC ModelInfer ("doesn't support models with decoupled transaction policy").
# ENSEMBLE_UNARY has the ensemble's inputs and outputs, is not decoupled, and relays each
# call to the ensemble (with stream=false) through BLS, so unary clients work too.
ENSEMBLE_UNARY = "ensemble_unary"
MODELS = (ENSEMBLE, PREPROCESSING, DFLASH, POSTPROCESSING, ENSEMBLE_UNARY)

# -- ensemble (client-facing) -----------------------------------------------------------------

TEXT_INPUT, MAX_TOKENS = "text_input", "max_tokens"
STREAM, TEMPERATURE, TOP_K, TOP_P, SEED = "stream", "temperature", "top_k", "top_p", "seed"
END_ID, PAD_ID, STOP_WORDS, BAD_WORDS = "end_id", "pad_id", "stop_words", "bad_words"
EXCLUDE_INPUT_IN_OUTPUT, RETURN_PERF_METRICS = "exclude_input_in_output", "return_perf_metrics"
CHAT, THINKING = "chat", "thinking"  # ours: apply the tokenizer's chat template to text_input
TEXT_OUTPUT = "text_output"
ACCEPTANCE_RATE, TOTAL_ACCEPTED_DRAFT_TOKENS = "acceptance_rate", "total_accepted_draft_tokens"
TOTAL_DRAFT_TOKENS, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS = "total_draft_tokens", "num_input_tokens", "num_output_tokens"
MEAN_ACCEPTANCE_LENGTH = "mean_acceptance_length"  # ours: tau, tokens per verify step

ENSEMBLE_INPUTS = (
    TensorSpec(TEXT_INPUT, STRING, optional=False),
    TensorSpec(MAX_TOKENS, INT32, optional=False),
    TensorSpec(STREAM, BOOL),
    TensorSpec(TEMPERATURE, FP32),
    TensorSpec(TOP_K, INT32),
    TensorSpec(TOP_P, FP32),
    TensorSpec(SEED, UINT64),
    TensorSpec(END_ID, INT32),
    TensorSpec(PAD_ID, INT32),
    TensorSpec(STOP_WORDS, STRING, (-1,)),
    TensorSpec(BAD_WORDS, STRING, (-1,)),
    TensorSpec(EXCLUDE_INPUT_IN_OUTPUT, BOOL),
    TensorSpec(RETURN_PERF_METRICS, BOOL),
    TensorSpec(CHAT, BOOL),
    TensorSpec(THINKING, BOOL),
)
# Perf outputs are present only in responses to requests with return_perf_metrics=true.
PERF_OUTPUTS = (
    TensorSpec(ACCEPTANCE_RATE, FP32),
    TensorSpec(TOTAL_ACCEPTED_DRAFT_TOKENS, INT32),
    TensorSpec(TOTAL_DRAFT_TOKENS, INT32),
    TensorSpec(NUM_INPUT_TOKENS, INT32),
    TensorSpec(NUM_OUTPUT_TOKENS, INT32),
    TensorSpec(MEAN_ACCEPTANCE_LENGTH, FP32),
)
ENSEMBLE_OUTPUTS = (TensorSpec(TEXT_OUTPUT, STRING, (-1,)), *PERF_OUTPUTS)

# -- preprocessing ----------------------------------------------------------------------------

QUERY, REQUEST_OUTPUT_LEN = "QUERY", "REQUEST_OUTPUT_LEN"
STOP_WORDS_DICT, BAD_WORDS_DICT = "STOP_WORDS_DICT", "BAD_WORDS_DICT"
END_ID_IN, PAD_ID_IN, CHAT_IN, THINKING_IN = "END_ID", "PAD_ID", "CHAT", "THINKING"
INPUT_ID, REQUEST_INPUT_LEN = "INPUT_ID", "REQUEST_INPUT_LEN"
STOP_WORDS_IDS, BAD_WORDS_IDS = "STOP_WORDS_IDS", "BAD_WORDS_IDS"
OUT_END_ID, OUT_PAD_ID = "OUT_END_ID", "OUT_PAD_ID"
NO_END_ID = -1  # OUT_END_ID when the client gave none: the engine's own eos/stop tokens apply

PREPROCESSING_INPUTS = (
    TensorSpec(QUERY, STRING, optional=False),
    TensorSpec(REQUEST_OUTPUT_LEN, INT32, optional=False),
    TensorSpec(STOP_WORDS_DICT, STRING, (-1,)),
    TensorSpec(BAD_WORDS_DICT, STRING, (-1,)),
    TensorSpec(END_ID_IN, INT32),
    TensorSpec(PAD_ID_IN, INT32),
    TensorSpec(CHAT_IN, BOOL),
    TensorSpec(THINKING_IN, BOOL),
)
# Word lists use TensorRT-LLM's [2, N] int32 format: row 0 the concatenated token ids of all
# words, row 1 the cumulative end offsets padded with -1; no words is [2, 0].
PREPROCESSING_OUTPUTS = (
    TensorSpec(INPUT_ID, INT32, (-1,)),
    TensorSpec(REQUEST_INPUT_LEN, INT32),
    TensorSpec(REQUEST_OUTPUT_LEN, INT32),
    TensorSpec(STOP_WORDS_IDS, INT32, (2, -1)),
    TensorSpec(BAD_WORDS_IDS, INT32, (2, -1)),
    TensorSpec(OUT_END_ID, INT32),
    TensorSpec(OUT_PAD_ID, INT32),
)

# -- dflash -----------------------------------------------------------------------------------

STREAM_IN, TEMPERATURE_IN, TOP_K_IN, TOP_P_IN, SEED_IN = "STREAM", "TEMPERATURE", "TOP_K", "TOP_P", "SEED"
EXCLUDE_INPUT_IN_OUTPUT_IN, RETURN_PERF_METRICS_IN = "EXCLUDE_INPUT_IN_OUTPUT", "RETURN_PERF_METRICS"
OUTPUT_TEXT = "OUTPUT_TEXT"  # the text of one response: a stream chunk, or the whole output

DFLASH_INPUTS = (
    TensorSpec(INPUT_ID, INT32, (-1,), optional=False),
    TensorSpec(REQUEST_INPUT_LEN, INT32, optional=False),
    TensorSpec(REQUEST_OUTPUT_LEN, INT32, optional=False),
    TensorSpec(END_ID_IN, INT32),
    TensorSpec(PAD_ID_IN, INT32),
    TensorSpec(STOP_WORDS_IDS, INT32, (2, -1)),
    TensorSpec(BAD_WORDS_IDS, INT32, (2, -1)),
    TensorSpec(STREAM_IN, BOOL),
    TensorSpec(TEMPERATURE_IN, FP32),
    TensorSpec(TOP_K_IN, INT32),
    TensorSpec(TOP_P_IN, FP32),
    TensorSpec(SEED_IN, UINT64),
    TensorSpec(EXCLUDE_INPUT_IN_OUTPUT_IN, BOOL),
    TensorSpec(RETURN_PERF_METRICS_IN, BOOL),
)
# Internal perf tensors carry the UPPER_SNAKE form of the ensemble names.
PERF_INTERNAL = {spec.name: spec.name.upper() for spec in PERF_OUTPUTS}
DFLASH_OUTPUTS = (
    TensorSpec(OUTPUT_TEXT, STRING, (-1,)),
    *(TensorSpec(PERF_INTERNAL[s.name], s.dtype, s.dims) for s in PERF_OUTPUTS),
)

# -- postprocessing ---------------------------------------------------------------------------

OUTPUT = "OUTPUT"
POSTPROCESSING_INPUTS = (
    TensorSpec(OUTPUT_TEXT, STRING, (-1,), optional=False),
    *(TensorSpec(PERF_INTERNAL[s.name], s.dtype, s.dims) for s in PERF_OUTPUTS),
)
POSTPROCESSING_OUTPUTS = (
    TensorSpec(OUTPUT, STRING, (-1,)),
    *(TensorSpec(PERF_INTERNAL[s.name], s.dtype, s.dims) for s in PERF_OUTPUTS),
)

MODEL_INPUTS = {ENSEMBLE: ENSEMBLE_INPUTS, PREPROCESSING: PREPROCESSING_INPUTS, DFLASH: DFLASH_INPUTS,
                POSTPROCESSING: POSTPROCESSING_INPUTS, ENSEMBLE_UNARY: ENSEMBLE_INPUTS}
MODEL_OUTPUTS = {ENSEMBLE: ENSEMBLE_OUTPUTS, PREPROCESSING: PREPROCESSING_OUTPUTS, DFLASH: DFLASH_OUTPUTS,
                 POSTPROCESSING: POSTPROCESSING_OUTPUTS, ENSEMBLE_UNARY: ENSEMBLE_OUTPUTS}

# -- ensemble wiring: per step, {model tensor: ensemble tensor} --------------------------------


@dataclass(frozen=True)
class Step:
    model: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]


def _internal(name: str) -> str:
    return f"_{name}"


_PREPROCESSED = (INPUT_ID, REQUEST_INPUT_LEN, REQUEST_OUTPUT_LEN, STOP_WORDS_IDS, BAD_WORDS_IDS)
_END_PAD = ((OUT_END_ID, "_PREPROCESSOR_END_ID"), (OUT_PAD_ID, "_PREPROCESSOR_PAD_ID"))  # TensorRT-LLM's names
_GENERATED = (OUTPUT_TEXT, *PERF_INTERNAL.values())

ENSEMBLE_STEPS = (
    Step(PREPROCESSING,
         inputs=((QUERY, TEXT_INPUT), (REQUEST_OUTPUT_LEN, MAX_TOKENS), (STOP_WORDS_DICT, STOP_WORDS),
                 (BAD_WORDS_DICT, BAD_WORDS), (END_ID_IN, END_ID), (PAD_ID_IN, PAD_ID), (CHAT_IN, CHAT),
                 (THINKING_IN, THINKING)),
         outputs=(*((name, _internal(name)) for name in _PREPROCESSED), *_END_PAD)),
    Step(DFLASH,
         inputs=(*((name, _internal(name)) for name in _PREPROCESSED),
                 (END_ID_IN, _END_PAD[0][1]), (PAD_ID_IN, _END_PAD[1][1]),
                 (STREAM_IN, STREAM), (TEMPERATURE_IN, TEMPERATURE), (TOP_K_IN, TOP_K), (TOP_P_IN, TOP_P),
                 (SEED_IN, SEED), (EXCLUDE_INPUT_IN_OUTPUT_IN, EXCLUDE_INPUT_IN_OUTPUT),
                 (RETURN_PERF_METRICS_IN, RETURN_PERF_METRICS)),
         outputs=tuple((name, _internal(name)) for name in _GENERATED)),
    Step(POSTPROCESSING,
         inputs=tuple((name, _internal(name)) for name in _GENERATED),
         outputs=((OUTPUT, TEXT_OUTPUT), *((up, low) for low, up in PERF_INTERNAL.items()))),
)


# -- reading request tensors ------------------------------------------------------------------


class RequestValidationError(RequestError):
    """A request the server rejects; the message goes back to the client verbatim."""


def _fail(message: str):
    raise RequestValidationError(message)


# Triton 2.51's BLS hands a called model's error back as INTERNAL whatever its code was, and
# ensemble_unary relays through BLS: so a client error also says so in its text, in this one
# form, which the relay recognises (the ensemble prefixes its own context to the message).
CLIENT_ERROR = "invalid request: "


def triton_error(pb_utils, message: str, client_error: bool):
    """The TritonError of a failed request: INVALID_ARG (HTTP 400) and marked when the client
    is at fault, INTERNAL (500) when the server is."""
    if client_error:
        return pb_utils.TritonError(CLIENT_ERROR + message, pb_utils.TritonError.INVALID_ARG)
    return pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL)


def is_client_error(message: str) -> bool:
    return CLIENT_ERROR in message


def read_inputs(get: Callable[[str], np.ndarray | None], specs) -> dict[str, np.ndarray]:
    """The request's tensors by name, via `get(name)` (None when absent), dtype- and shape-checked.

    Checks the batch dimension too: one prompt per request."""
    arrays = {}
    for spec in specs:
        array = get(spec.name)
        if array is None:
            if not spec.optional:
                _fail(f"missing required input '{spec.name}'")
            continue
        arrays[spec.name] = _check_array(spec, np.asarray(array))
    return arrays


def read_request(pb_utils, request, specs) -> dict[str, np.ndarray]:
    """`read_inputs` for a Triton request; `pb_utils` is passed in because only the Python
    backend's stub can import it (the model.py adapters hand it over)."""

    def get(name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    return read_inputs(get, specs)


def _check_array(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    expected = NUMPY_DTYPES[spec.dtype]
    if spec.dtype == STRING:
        ok = array.dtype == np.object_ or array.dtype.kind in "SU"
    else:
        ok = array.dtype == expected
    if not ok:
        _fail(f"input '{spec.name}' must be {spec.dtype}, got {array.dtype.name}")
    shape_ok = array.ndim == len(spec.dims) + 1 and all(
        want in (-1, got) for want, got in zip(spec.dims, array.shape[1:]))
    if not shape_ok:
        _fail(f"input '{spec.name}' must have shape [batch, {', '.join(map(str, spec.dims))}], "
              f"got {list(array.shape)}")
    if array.shape[0] != 1:
        _fail(f"input '{spec.name}' has batch size {array.shape[0]}; send one prompt per request (batch size 1)")
    return array[0]


def _scalar(arrays, name, kind, default=None):
    if name not in arrays:
        return default
    value = arrays[name].reshape(-1)
    if value.size != 1:
        _fail(f"input '{name}' must hold one value, got {value.size}")
    return kind(value[0])


def _text(value) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            _fail(f"text is not valid UTF-8 ({e})")
    return str(value)


def _strings(arrays, name) -> tuple[str, ...]:
    """A STRING [-1] list; empty strings are dropped (clients send "" for "none")."""
    if name not in arrays:
        return ()
    return tuple(s for s in (_text(v) for v in arrays[name].reshape(-1)) if s)


# -- word lists -------------------------------------------------------------------------------


def pack_word_list(words: list[list[int]]) -> np.ndarray:
    """Token-id sequences -> TensorRT-LLM's [2, N] int32 word-list format."""
    flat = [t for w in words for t in w]
    offsets = np.cumsum([len(w) for w in words], dtype=np.int64).tolist()
    packed = np.full((2, len(flat)), -1, dtype=np.int32)
    packed[0, :] = flat
    packed[1, : len(offsets)] = offsets
    return packed


def unpack_word_list(packed: np.ndarray) -> tuple[tuple[int, ...], ...]:
    if packed.ndim != 2 or packed.shape[0] != 2:
        _fail(f"a word list must have shape [2, N], got {list(packed.shape)}")
    ids, ends = packed[0].tolist(), [e for e in packed[1].tolist() if e >= 0]
    if any(b <= a for a, b in zip([0] + ends, ends)) or (ends and ends[-1] > len(ids)):
        _fail(f"word list offsets {ends} are not increasing within 0..{len(ids)}")
    return tuple(tuple(ids[a:b]) for a, b in zip([0] + ends, ends))


# -- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """What one built engine accepts (its build config's limits)."""

    max_input_len: int
    max_output_len: int


@dataclass(frozen=True)
class Query:
    """What preprocessing reads: the client's text-level request."""

    text: str
    max_tokens: int
    stop_words: tuple[str, ...] = ()
    bad_words: tuple[str, ...] = ()
    end_id: int | None = None
    pad_id: int | None = None
    chat: bool = False
    thinking: bool = False

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], max_text_bytes: int | None = None) -> "Query":
        """`max_text_bytes` bounds each text input before anything decodes or tokenizes it."""
        if max_text_bytes is not None:
            for name, client_name in ((QUERY, TEXT_INPUT), (STOP_WORDS_DICT, STOP_WORDS), (BAD_WORDS_DICT, BAD_WORDS)):
                size = sum(len(v.encode() if isinstance(v, str) else v) for v in arrays.get(name, np.empty(0)).flat)
                if size > max_text_bytes:
                    _fail(f"'{client_name}' is {size:,} bytes, more than this engine takes ({max_text_bytes:,}: "
                          f"max_input_bytes, see the build config)")
        return cls(
            text=_scalar(arrays, QUERY, _text),
            max_tokens=_scalar(arrays, REQUEST_OUTPUT_LEN, int),
            stop_words=_strings(arrays, STOP_WORDS_DICT),
            bad_words=_strings(arrays, BAD_WORDS_DICT),
            end_id=_scalar(arrays, END_ID_IN, int),
            pad_id=_scalar(arrays, PAD_ID_IN, int),
            chat=_scalar(arrays, CHAT_IN, bool, False),
            thinking=_scalar(arrays, THINKING_IN, bool, False),
        )

    def validate(self) -> None:
        if not self.text:
            _fail(f"'{TEXT_INPUT}' is empty")
        if self.bad_words:
            _fail(f"'{BAD_WORDS}' is not supported by dflash-trt (got {list(self.bad_words)})")
        if self.end_id is not None and self.end_id < 0:
            _fail(f"'{END_ID}' must be a token id >= 0, got {self.end_id}")


@dataclass(frozen=True)
class Request:
    """What the dflash model reads: a tokenized request and its decoding settings."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    stream: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None  # None: the engine's eos and the tokenizer's stop tokens end generation
    stop_words: tuple[tuple[int, ...], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    exclude_input_in_output: bool = False
    return_perf_metrics: bool = False

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> "Request":
        ids = arrays[INPUT_ID].reshape(-1)
        length = _scalar(arrays, REQUEST_INPUT_LEN, int)
        if not 0 <= length <= ids.size:
            _fail(f"'{REQUEST_INPUT_LEN}' is {length}, but '{INPUT_ID}' holds {ids.size} tokens")
        end_id = _scalar(arrays, END_ID_IN, int)
        return cls(
            prompt_ids=tuple(ids[:length].tolist()),
            max_tokens=_scalar(arrays, REQUEST_OUTPUT_LEN, int),
            stream=_scalar(arrays, STREAM_IN, bool, False),
            temperature=_scalar(arrays, TEMPERATURE_IN, float, 0.0),
            top_k=_scalar(arrays, TOP_K_IN, int, 0),
            top_p=_scalar(arrays, TOP_P_IN, float, 1.0),
            seed=_scalar(arrays, SEED_IN, int),
            end_id=None if end_id in (None, NO_END_ID) else end_id,
            stop_words=unpack_word_list(arrays[STOP_WORDS_IDS]) if STOP_WORDS_IDS in arrays else (),
            bad_words=unpack_word_list(arrays[BAD_WORDS_IDS]) if BAD_WORDS_IDS in arrays else (),
            exclude_input_in_output=_scalar(arrays, EXCLUDE_INPUT_IN_OUTPUT_IN, bool, False),
            return_perf_metrics=_scalar(arrays, RETURN_PERF_METRICS_IN, bool, False),
        )

    def validate(self, limits: Limits, vocab_size: int) -> None:
        """What the build's limits and the protocol decide. The sampling values are checked where
        they become SamplingParams, and the prompt ids against the model by Engine.add_request
        (emptiness, vocabulary, cache capacity): each field in one place."""
        if len(self.prompt_ids) > limits.max_input_len:
            _fail(f"the prompt is {len(self.prompt_ids)} tokens, more than this engine's max_input_len = "
                  f"{limits.max_input_len}")
        if self.max_tokens > limits.max_output_len:
            _fail(f"'{MAX_TOKENS}' is {self.max_tokens}, more than this engine's max_output_len = "
                  f"{limits.max_output_len}")
        if self.end_id is not None and not 0 <= self.end_id < vocab_size:
            _fail(f"'{END_ID}' {self.end_id} is outside the vocabulary (0..{vocab_size - 1})")
        if self.bad_words:
            _fail(f"'{BAD_WORDS}' is not supported by dflash-trt")
        if any(not w for w in self.stop_words):
            _fail(f"'{STOP_WORDS}' contains an empty word")
