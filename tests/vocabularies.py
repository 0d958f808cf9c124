"""Tiny tokenizers with real pre-tokenizer configurations, for the tokenizer tests (no downloads).

* :func:`build_bpe_tokenizer` writes ``tokenizer.json`` (+ ``tokenizer_config.json``) for a model
  family: the normalizer, pre-tokenizer, post-processor and decoder that family publishes in its
  ``tokenizer.json``, over a byte-level BPE vocabulary trained here with ``tokenizers``'
  ``BpeTrainer`` on :data:`CORPUS`.
* :func:`build_spm_tokenizer` writes ``tokenizer.model``: a SentencePiece BPE model with byte
  fallback trained here with ``sentencepiece``, with Llama 2's normalizer settings (``identity``,
  dummy prefix, extra whitespace kept, digits split).

:func:`tests.gguf_convert.write_vocab_gguf` turns either into a GGUF file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, trainers
from tokenizers.pre_tokenizers import ByteLevel

# Text to train on: prose, numbers, code, accents, CJK, emoji, contractions, whitespace.
CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.\n"
    "In 1999 there were 12 apples, 123 pears and 1234 plums: 12345 fruits in all, or 3.14 each.\n"
    "I'm sure they'll say it's fine, don't you think? We've seen it, she'd said. You're right.\n"
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "for (int i = 0; i < 10; ++i) { total += values[i]; }  // sum\n"
    "Café, naïve, résumé, façade, Ångström, São Paulo, Zürich, crème brûlée, jalapeño.\n"
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.\n"
    "Emoji: 🎉 👍🏽 🇫🇷 ❤️ 🚀 and more 🎉🎉.\n"
    "Tabs\tand  double  spaces,\n\nblank lines,   runs of spaces and trailing spaces   \n"
    "x² + y³ = z; ½ cup; Ⅻ o'clock.\n"
) * 8

# The text set every tokenizer test encodes: spaces (single, double, leading, trailing,
# newlines, tabs), digits, accents, CJK, emoji, contractions, code, special tokens.
TEXTS = (
    "The capital of France is Paris.",
    "single space",
    "double  space",
    "  two leading spaces",
    " one leading space",
    "trailing spaces   ",
    "new\nline",
    "two\n\nnewlines\n",
    "\n\n\nleading newlines",
    "tab\tseparated\tvalues",
    " \t \n mixed whitespace \r\n",
    "1 12 123 1234 12345",
    "1234567890",
    "3.14 and 2,718",
    "x² + y³",
    "Café naïve résumé Ångström crème brûlée",
    "東京は日本の首都です。",
    "北京是中国的首都",
    "서울은 한국의 수도",
    "emoji 🎉👍🏽 and flags 🇫🇷",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "SHE'S HERE, WE'LL GO, IT'S OK",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { total += values[i]; }",
    "!!!??? ... --- ((()))",
    "the zyzzyva",
    "a",
    "",
)

# A token no merge makes (llama-bpe's ignore_merges takes a piece that is a whole token as is).
UNMERGED_TOKEN = "\u0120zyzzyva"  # "Ġzyzzyva": " zyzzyva" in GPT-2's alphabet


@dataclass(frozen=True, slots=True)
class Family:
    """One model family's published tokenizer.json settings.

    Attributes:
        pre: the ``tokenizer.ggml.pre`` llama.cpp's converter writes for it.
        pre_tokenizer / normalizer / post_processor: the family's JSON, as published.
        specials: its special tokens (the first ones of the vocabulary).
        bos / eos: texts for tokenizer_config.json (None: none).
        ignore_merges: the BPE model's ``ignore_merges``.
    """

    pre: str
    pre_tokenizer: dict[str, Any]
    specials: tuple[str, ...]
    bos: str | None = None
    eos: str | None = None
    normalizer: dict[str, Any] | None = None
    post_processor: dict[str, Any] | None = None
    ignore_merges: bool = False
    extra_config: dict[str, Any] = field(default_factory=dict)


def _byte_level(*, use_regex: bool, trim_offsets: bool = True) -> dict[str, Any]:
    return {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": trim_offsets,
        "use_regex": use_regex,
    }


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


# Published regexes (the families' tokenizer.json files).
LLAMA3_PUBLISHED = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PUBLISHED = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's "default" (no family publishes it: it is llama.cpp's fallback), as Splits.
DEFAULT_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)

_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_STARCODER_PRE = {
    "type": "Sequence",
    "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(use_regex=True)],
}

FAMILIES: dict[str, Family] = {
    # openai-community/gpt2
    "gpt-2": Family("gpt-2", _byte_level(use_regex=True), ("<|endoftext|>",), eos="<|endoftext|>"),
    # bigcode/starcoder2 and HuggingFaceTB/SmolLM2 (same pre-tokenizer)
    "starcoder": Family("starcoder", _STARCODER_PRE, ("<|endoftext|>", "<fim_prefix>")),
    "smollm": Family("smollm", _STARCODER_PRE, _CHATML, bos="<|im_start|>", eos="<|im_end|>"),
    # meta-llama/Meta-Llama-3-8B
    "llama-bpe": Family(
        "llama-bpe",
        {
            "type": "Sequence",
            "pretokenizers": [_split(LLAMA3_PUBLISHED), _byte_level(use_regex=False)],
        },
        ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>"),
        bos="<|begin_of_text|>",
        eos="<|end_of_text|>",
        post_processor={
            "type": "Sequence",
            "processors": [
                {
                    "type": "ByteLevel",
                    "add_prefix_space": True,
                    "trim_offsets": False,
                    "use_regex": True,
                },
                {
                    "type": "TemplateProcessing",
                    "single": [
                        {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}},
                    ],
                    "pair": [
                        {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}},
                        {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                        {"Sequence": {"id": "B", "type_id": 1}},
                    ],
                    "special_tokens": {
                        "<|begin_of_text|>": {
                            "id": "<|begin_of_text|>",
                            "ids": [0],
                            "tokens": ["<|begin_of_text|>"],
                        }
                    },
                },
            ],
        },
        ignore_merges=True,
    ),
    # Qwen/Qwen2.5-0.5B
    "qwen2": Family(
        "qwen2",
        {
            "type": "Sequence",
            "pretokenizers": [
                _split(QWEN2_PUBLISHED),
                _byte_level(use_regex=False, trim_offsets=False),
            ],
        },
        _CHATML,
        eos="<|im_end|>",
        normalizer={"type": "NFC"},
    ),
    "default": Family(
        "default",
        {
            "type": "Sequence",
            "pretokenizers": [*(_split(r) for r in DEFAULT_SPLITS), _byte_level(use_regex=False)],
        },
        ("<|endoftext|>",),
        eos="<|endoftext|>",
    ),
}


def build_bpe_tokenizer(directory: Path, pre: str, *, vocab_size: int = 900) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of a tiny byte-level BPE tokenizer of
    the family that llama.cpp calls ``pre`` (a key of :data:`FAMILIES`); return ``directory``."""
    family = FAMILIES[pre]
    directory.mkdir(parents=True, exist_ok=True)
    # Trained on whole lines (no regex split), so the vocabulary has tokens across every
    # boundary a pre-tokenizer draws (" 12", "'s", "!!!", ".\n"): any split that differs from
    # the family's changes the ids.
    spec = json.loads(Tokenizer(models.BPE()).to_str())
    spec["normalizer"] = family.normalizer
    spec["pre_tokenizer"] = _byte_level(use_regex=False)
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(family.specials),
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    spec = json.loads(tokenizer.to_str())
    spec["model"]["ignore_merges"] = family.ignore_merges
    spec["model"]["vocab"][UNMERGED_TOKEN] = len(spec["model"]["vocab"])
    spec["pre_tokenizer"] = family.pre_tokenizer
    spec["post_processor"] = family.post_processor
    spec["decoder"] = {
        "type": "ByteLevel",
        "add_prefix_space": True,
        "trim_offsets": True,
        "use_regex": True,
    }
    (directory / "tokenizer.json").write_text(
        json.dumps(spec, ensure_ascii=False), encoding="utf-8"
    )
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **family.extra_config}
    if family.bos:
        config["bos_token"] = family.bos
    if family.eos:
        config["eos_token"] = family.eos
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def build_spm_tokenizer(directory: Path, *, vocab_size: int = 400) -> Path:
    """Write ``tokenizer.model`` (SentencePiece BPE with byte fallback, Llama 2's settings:
    ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2) and a ``tokenizer_config.json`` naming BOS/EOS; return
    ``directory``."""
    import sentencepiece

    directory.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.splitlines()),
        model_prefix=str(directory / "tokenizer"),
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=0.995,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    (directory / "tokenizer.vocab").unlink()
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory
