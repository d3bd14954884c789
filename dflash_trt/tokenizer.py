"""The runtime Qwen tokenizer the engine uses: read from a model directory, with its chat
template; it needs only `tokenizers` and `jinja2` (never `transformers`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dflash_trt.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# Qwen3.5 checkpoints ship their chat template in this file, not in tokenizer_config.json.
CHAT_TEMPLATE_FILE = "chat_template.jinja"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"


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

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token: byte-level BPE spells each byte as one character,
        added tokens are their text."""
        regular = max(map(len, self._backend.get_vocab(with_added_tokens=False)), default=1)
        added = (len(t.content.encode()) for t in self._backend.get_added_tokens_decoder().values())
        return max(regular, *added)

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
