"""Byte-level BPE from a GGUF file (``tokenizer.ggml.model == "gpt2"``), pre-tokenized as
llama.cpp does for the file's ``tokenizer.ggml.pre``.

Source of every rule: llama.cpp's ``llama-vocab.cpp`` (``llm_tokenizer_bpe``: the regexes of each
pre-tokenizer type; ``llama_vocab::impl::load``: which ``tokenizer.ggml.pre`` names map to which
type, and their flags). llama.cpp applies a type's regexes one after the other, each splitting
the pieces the previous one left, a match and the text between two matches becoming pieces of
their own; then it maps every byte of a piece to GPT-2's alphabet and merges by rank. We build
that with Hugging Face ``tokenizers``: one ``Split(regex, "isolated")`` per regex, then
``ByteLevel(use_regex=False)``, then ``BPE`` over the file's vocabulary and merges. The regexes
are llama.cpp's spelling (``(?:'[sS]|'[tT]...)`` for the published ``(?i:'s|'t...)``).

Tokens of type CONTROL, USER_DEFINED and UNKNOWN are matched in the text before pre-tokenizing
and become their single id (llama.cpp's ``tokenizer_st_partition`` with ``parse_special``, which
its server uses for prompts). They decode to no bytes (CONTROL, UNKNOWN) or to their text as
written (USER_DEFINED, which the converter stores pre-normalized); every other token decodes
through GPT-2's byte alphabet.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from app.models.tokenizers.byte_level import byte_level_token_bytes
from app.models.tokenizers.gguf_vocab import GGUFTokenType, GGUFVocab, add_gguf_added_tokens
from app.models.tokenizers.text_tokenizer import TextTokenizer, UnsupportedTokenizerError

# GPT-2's regex as llama.cpp writes it (no final "|\s+": the text it would match becomes a piece
# of its own anyway, between two matches).
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# Llama 3's tokenizer.json regex (tiktoken's cl100k): numbers in runs of at most three digits.
LLAMA3_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: the same with every digit on its own.
QWEN2_REGEX = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class PreTokenizerRule:
    """How llama.cpp pre-tokenizes for one family of ``tokenizer.ggml.pre`` names.

    Attributes:
        regexes: applied in order, each one isolating its matches in the pieces left so far.
        ignore_merges: a piece that is a whole vocabulary token is that token, whatever the
            merges say (llama.cpp's ``ignore_merges``; ``BPE(ignore_merges=True)``).
        add_bos_token: llama.cpp's default when the file has no ``add_bos_token`` key.
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos_token: bool = False


DEFAULT = PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]"))
LLAMA3 = PreTokenizerRule((LLAMA3_REGEX,), ignore_merges=True, add_bos_token=True)
LLAMA3_REGEX_ONLY = PreTokenizerRule((LLAMA3_REGEX,))  # dbrx, smaug: same split, no flags
QWEN2 = PreTokenizerRule((QWEN2_REGEX,))
STARCODER = PreTokenizerRule((r"\p{N}", GPT2_REGEX))  # every numeric character on its own
GPT2 = PreTokenizerRule((GPT2_REGEX,))

# tokenizer.ggml.pre -> rule, for the names llama.cpp maps to these types.
PRE_TOKENIZERS: dict[str, PreTokenizerRule] = {
    "default": DEFAULT,
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        LLAMA3,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), LLAMA3_REGEX_ONLY),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan"), QWEN2
    ),
    **dict.fromkeys(
        ("starcoder", "smollm", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        STARCODER,
    ),
    **dict.fromkeys(
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "mellum", "a.x-4.0", "exaone4"),
        GPT2,
    ),
}


def pre_tokenizer_rule(name: str) -> PreTokenizerRule:
    """The rule for a ``tokenizer.ggml.pre`` name.

    Raises:
        UnsupportedTokenizerError: a name we do not build (llama.cpp has more).
    """
    if name not in PRE_TOKENIZERS:
        raise UnsupportedTokenizerError(
            f"BPE pre-tokenizer {name!r} is not supported "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    return PRE_TOKENIZERS[name]


def _token_bytes(text: str, kind: GGUFTokenType) -> bytes:
    if kind in (GGUFTokenType.CONTROL, GGUFTokenType.UNKNOWN, GGUFTokenType.UNUSED):
        return b""
    if kind is GGUFTokenType.USER_DEFINED:
        return text.encode("utf-8")
    return byte_level_token_bytes(text)


def build_gguf_bpe(vocab: GGUFVocab) -> TextTokenizer:
    """The tokenizer of a ``gpt2`` GGUF vocabulary.

    Raises:
        UnsupportedTokenizerError: its pre-tokenizer is not in :data:`PRE_TOKENIZERS`.
        ValueError: ``vocab`` is not a ``gpt2`` vocabulary, has no merges, or adds BOS/EOS
            without one.
    """
    if vocab.model != "gpt2":
        raise ValueError(f"expected a gpt2 vocabulary, got {vocab.model!r}")
    if not vocab.merges:  # llama.cpp refuses the file too
        raise ValueError("the gpt2 vocabulary has no tokenizer.ggml.merges")
    rule = pre_tokenizer_rule(vocab.pre)
    hf = HFTokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(vocab.tokens)},
            merges=list(vocab.merges),
            fuse_unk=False,
            ignore_merges=rule.ignore_merges,
        )
    )
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in rule.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    add_gguf_added_tokens(hf, vocab)
    add_bos = vocab.add_bos_token
    if add_bos is None:  # the family's default, where the vocabulary has a BOS to add
        add_bos = rule.add_bos_token and vocab.bos_token_id is not None
    return TextTokenizer(
        hf,
        token_bytes=[
            _token_bytes(text, kind)
            for text, kind in zip(vocab.tokens, vocab.token_types, strict=True)
        ],
        bos_token_id=vocab.bos_token_id,
        eos_token_id=vocab.eos_token_id,
        end_of_generation_ids=vocab.end_of_turn_ids,
        add_bos_token=add_bos,
        add_eos_token=bool(vocab.add_eos_token),
        chat_template=vocab.chat_template,
        kind=f"gguf gpt2/{vocab.pre}",
    )
