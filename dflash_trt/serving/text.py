"""The text ends of serving, behind the `preprocessing` and `postprocessing` Triton models,
and the incremental detokenizer the engine worker streams with. Free of Triton and of torch,
so those models' stubs stay small.

- `Preprocessor`: text request -> token ids, stop-word lists, resolved end/pad ids.
- `postprocess`: what the postprocessing model does to each dflash response.
- `IncrementalDetokenizer`: stream chunks that never split a character.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from dflash_trt.config import TOKENIZER_DIR, read_engine_record
from dflash_trt.errors import DFlashError
from dflash_trt.serving import protocol as p
from dflash_trt.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"  # what decoding puts in place of an incomplete UTF-8 sequence


def _batch1(array) -> np.ndarray:
    return np.asarray(array)[np.newaxis]


# -- preprocessing ----------------------------------------------------------------------------


def max_text_bytes(max_input_len: int, tokenizer) -> int:
    """The most UTF-8 bytes a text of max_input_len tokens can have, so that a longer text is
    refused before it is tokenized: each token spells at most max_token_bytes bytes, and the
    tokenizer's NFC normalization shrinks a text at most 3x (Hangul jamo composing)."""
    return max_input_len * tokenizer.max_token_bytes * 3


class Preprocessor:
    """Tokenizes one request for the dflash model (the preprocessing model's logic)."""

    def __init__(self, tokenizer, max_text_bytes: int):
        self.tokenizer, self.max_text_bytes = tokenizer, max_text_bytes

    @classmethod
    def load(cls, engine_dir: Path) -> "Preprocessor":
        _, config = read_engine_record(engine_dir)
        tokenizer = Tokenizer.from_dir(Path(engine_dir) / TOKENIZER_DIR)
        return cls(tokenizer, config.max_input_bytes or max_text_bytes(config.max_input_len, tokenizer))

    def __call__(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        query = p.Query.from_arrays(arrays, self.max_text_bytes)
        query.validate()
        ids = self.tokenizer.encode(self._prompt(query))
        stop_words = [self.tokenizer.encode(w) for w in query.stop_words]
        return {
            p.INPUT_ID: _batch1(np.array(ids, dtype=np.int32)),
            p.REQUEST_INPUT_LEN: _batch1(np.array([len(ids)], dtype=np.int32)),
            p.REQUEST_OUTPUT_LEN: _batch1(np.array([query.max_tokens], dtype=np.int32)),
            p.STOP_WORDS_IDS: _batch1(p.pack_word_list(stop_words)),
            p.BAD_WORDS_IDS: _batch1(p.pack_word_list([])),
            p.OUT_END_ID: _batch1(np.array([p.NO_END_ID if query.end_id is None else query.end_id], np.int32)),
            p.OUT_PAD_ID: _batch1(np.array([self.tokenizer.pad_token_id if query.pad_id is None else query.pad_id],
                                           np.int32)),
        }

    def _prompt(self, query: p.Query) -> str:
        if not query.chat:
            return query.text  # raw prompts behave like TensorRT-LLM's
        try:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": query.text}],
                                                      add_generation_prompt=True, enable_thinking=query.thinking)
        except DFlashError as e:
            raise p.RequestValidationError(f"'{p.CHAT}' is true, but the chat template failed: {e}") from None


# -- postprocessing ---------------------------------------------------------------------------


def postprocess(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """dflash response tensors (batch dimension removed, as `read_inputs` returns them) ->
    postprocessing outputs: the text becomes OUTPUT, perf metrics pass when present."""
    out = {p.OUTPUT: arrays[p.OUTPUT_TEXT]}
    out.update({name: arrays[name] for name in p.PERF_INTERNAL.values() if name in arrays})
    return {name: _batch1(array) for name, array in out.items()}


# -- text -------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Decodes a growing token list into chunks whose concatenation is decode(all tokens).

    Invariant: the tokens before `_start` decode to text ending on a character boundary. A
    byte-level decode restarts cleanly at such a boundary, so decode(ids[:s]) + decode(ids[s:])
    == decode(ids). Pending tokens are held back while their text ends in U+FFFD, which is how
    an incomplete UTF-8 sequence decodes; `flush` emits whatever is left at the end.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._start = 0

    def push(self, ids: list[int]) -> str:
        self._ids += ids
        text = self._decode(self._ids[self._start:])
        if text.endswith(REPLACEMENT_CHAR):
            return ""
        self._start = len(self._ids)
        return text

    def flush(self) -> str:
        text = self._decode(self._ids[self._start:]) if self._start < len(self._ids) else ""
        self._start = len(self._ids)
        return text
