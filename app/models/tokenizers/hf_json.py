"""The tokenizer of a Hugging Face model directory: ``tokenizer.json`` as is, plus the files
around it.

* ``tokenizer.json`` (``tokenizers.Tokenizer.from_file``) tokenizes; its added tokens are matched
  in the text. What a token decodes to follows the file's decoder: byte-level files
  (``ByteLevel``) through GPT-2's byte alphabet, SentencePiece-style files (``Metaspace``,
  ``Replace("▁", " ")``, ``ByteFallback``) with ``▁`` as a space and ``<0xNN>`` as a byte.
  Special added tokens decode to nothing (vLLM's ``skip_special_tokens=True``), other added
  tokens to their text.
* BOS/EOS: ``bos_token``/``eos_token`` from ``tokenizer_config.json`` (a string or an
  ``{"content": ...}`` object). ``add_bos_token``/``add_eos_token`` from the same file when it has
  them (what transformers' Llama tokenizers follow), else from ``tokenizer.json``'s
  post-processor (a ``TemplateProcessing`` that starts or ends with a special token, as Llama 3's
  does).
* End of generation: ``eos_token_id`` of ``generation_config.json`` (an id or a list, as vLLM
  reads it; else of ``config.json``), the EOS token, and the special tokens whose text is one of
  llama.cpp's end-of-generation markers.
* Chat template: ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named
  templates of which we take "default"), else ``chat_template.jinja`` (where transformers 5 saves
  it), else ``chat_template.json``.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from app.models.tokenizers.byte_level import byte_level_token_bytes
from app.models.tokenizers.text_tokenizer import TextTokenizer, UnsupportedTokenizerError

logger = logging.getLogger(__name__)

SPACE = "\u2581"  # ▁
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or {} when there is no such file.

    Raises:
        ValueError: the file is not a JSON object.
    """
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return value


def _components(node: Any) -> list[dict[str, Any]]:
    """A decoder/pre-tokenizer node and, for a ``Sequence``, its parts (flattened)."""
    if not isinstance(node, dict):
        return []
    parts = node.get("decoders") or node.get("pretokenizers") or []
    return [node, *(c for part in parts for c in _components(part))]


def _is_byte_level(spec: dict[str, Any]) -> bool:
    """True for a byte-level file, False for a SentencePiece-style one.

    Raises:
        UnsupportedTokenizerError: a decoder that is neither.
    """
    decoder = _components(spec.get("decoder"))
    types = {c.get("type") for c in decoder + _components(spec.get("pre_tokenizer"))}
    if "ByteLevel" in types:
        return True
    spm_decoder = {"Metaspace", "ByteFallback"} & types or any(
        c.get("type") == "Replace" and c.get("pattern", {}).get("String") == SPACE for c in decoder
    )
    if spm_decoder or spec.get("model", {}).get("byte_fallback"):
        return False
    kind = (spec.get("decoder") or {}).get("type")
    raise UnsupportedTokenizerError(
        f"tokenizer.json decoder {kind!r} is not supported (ByteLevel or SentencePiece-style)"
    )


def _sentencepiece_bytes(text: str) -> bytes:
    match = _BYTE_TOKEN.fullmatch(text)
    if match:
        return bytes((int(match.group(1), 16),))
    return text.replace(SPACE, " ").encode("utf-8")


def _token_bytes(
    hf: HFTokenizer, spec: dict[str, Any], size: int, *, byte_level: bool
) -> list[bytes]:
    """What each id in ``[0, size)`` decodes to: nothing for special added tokens and ids with
    no token, the text of other added tokens, else the model token's bytes."""
    special_ids = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    added_ids = {t["id"] for t in spec.get("added_tokens", [])}
    token_bytes: list[bytes] = []
    for token_id in range(size):
        text = hf.id_to_token(token_id)
        if text is None or token_id in special_ids:
            token_bytes.append(b"")
        elif token_id in added_ids:
            token_bytes.append(text.encode("utf-8"))
        elif byte_level:
            token_bytes.append(byte_level_token_bytes(text))
        else:
            token_bytes.append(_sentencepiece_bytes(text))
    return token_bytes


def _token_content(entry: Any) -> str | None:
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict) and isinstance(entry.get("content"), str):
        return entry["content"]
    return None


def _post_processor_specials(spec: dict[str, Any]) -> tuple[str | None, str | None]:
    """The special tokens ``tokenizer.json``'s post-processor puts before and after a single
    sequence (TemplateProcessing only), e.g. ``("<|begin_of_text|>", None)`` for Llama 3."""
    node = spec.get("post_processor") or {}
    processors = node.get("processors", [node]) if node.get("type") == "Sequence" else [node]
    for processor in processors:
        if processor.get("type") != "TemplateProcessing":
            continue
        single = processor.get("single") or []
        first = single[0].get("SpecialToken", {}).get("id") if single else None
        last = single[-1].get("SpecialToken", {}).get("id") if len(single) > 1 else None
        return first, last
    return None, None


def _chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(directory / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def load_hf_tokenizer(directory: Path | str, *, vocab_size: int | None = None) -> TextTokenizer:
    """The tokenizer of the model in ``directory``.

    Args:
        vocab_size: the model's vocabulary size when it is larger than the tokenizer's (padded
            embeddings): the ids past the tokenizer's decode to nothing.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` in ``directory``.
        UnsupportedTokenizerError: a ``tokenizer.json`` decoder we cannot turn into bytes.
        ValueError: a malformed JSON file; a BOS/EOS to add that the vocabulary lacks.
    """
    directory = Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no tokenizer.json")
    spec = _read_json(path)
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot read
        raise ValueError(f"{path}: {exc}") from None
    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    generation_config = _read_json(directory / "generation_config.json")
    model_config = _read_json(directory / "config.json")

    byte_level = _is_byte_level(spec)
    size = max(hf.get_vocab_size(with_added_tokens=True), vocab_size or 0)
    token_bytes = _token_bytes(hf, spec, size, byte_level=byte_level)
    leading, trailing = _post_processor_specials(spec)
    bos_text = _token_content(tokenizer_config.get("bos_token")) or leading
    eos_text = _token_content(tokenizer_config.get("eos_token"))
    bos_id = None if bos_text is None else hf.token_to_id(bos_text)
    eos_id = None if eos_text is None else hf.token_to_id(eos_text)
    generation_eos = _ids(generation_config.get("eos_token_id", model_config.get("eos_token_id")))
    if eos_id is None and generation_eos:
        eos_id = generation_eos[0]
    add_bos = tokenizer_config.get("add_bos_token")
    add_eos = tokenizer_config.get("add_eos_token")
    if not isinstance(add_bos, bool):
        add_bos = leading is not None
    if not isinstance(add_eos, bool):
        add_eos = trailing is not None
    return TextTokenizer(
        hf,
        token_bytes=token_bytes,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        end_of_generation_ids=frozenset(generation_eos),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=_chat_template(directory, tokenizer_config),
        kind="tokenizer.json " + ("byte-level" if byte_level else "sentencepiece"),
    )
