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


def byte_level_token_bytes(text: str) -> bytes:
    """The raw bytes a byte-level token spells. A character outside the alphabet (a malformed
    vocabulary entry) stands for its own UTF-8 bytes."""
    stand_ins = byte_stand_ins()
    return b"".join(
        bytes((stand_ins[char],)) if char in stand_ins else char.encode("utf-8") for char in text
    )
