"""TextAssembler: UTF-8 safety and stop strings."""

from __future__ import annotations

import pytest

from app.engine.detokenizer import TextAssembler


def feed(assembler: TextAssembler, chunks: list[bytes]) -> list[str]:
    out = []
    for chunk in chunks:
        out.append(assembler.append(chunk))
        if assembler.matched_stop is not None:
            break
    return out


def test_multibyte_character_held_until_complete():
    assembler = TextAssembler()
    data = "中".encode()
    assert feed(assembler, [data[:1], data[1:2], data[2:]]) == ["", "", "中"]


def test_incomplete_character_dropped_at_flush_not_replaced():
    assembler = TextAssembler()
    assembler.append(b"a" + "😀".encode()[:2])
    assert assembler.flush() == ""
    assert "\ufffd" not in assembler.text


def test_stop_string_inside_one_token_cuts_the_rest():
    assembler = TextAssembler(["is."])
    released = feed(assembler, [b"Paris. Next"])
    assert assembler.matched_stop == "is."
    assert "".join(released) == "Par"
    assert assembler.text == "Par"


def test_stop_string_spanning_tokens_is_held_then_trimmed():
    assembler = TextAssembler(["<end>"])
    released = feed(assembler, [b"ab<", b"en", b"d>zz"])
    assert released == ["ab", "", ""]
    assert assembler.text == "ab"


def test_false_start_is_released_when_decided():
    assembler = TextAssembler(["<end>"])
    released = feed(assembler, [b"a<e", b"x"])
    assert released == ["a", "<ex"]
    assert assembler.matched_stop is None


def test_earliest_of_several_stops_wins():
    assembler = TextAssembler(["world", "lo w"])
    feed(assembler, [b"hello world"])
    assert assembler.matched_stop == "lo w"
    assert assembler.text == "hel"


def test_flush_releases_held_prefix_when_generation_ends():
    assembler = TextAssembler(["STOP"])
    assert assembler.append(b"abST") == "ab"
    assert assembler.flush() == "ST"


@pytest.mark.parametrize("text", ["日本語のテキスト", "emoji 😀🎉 mix", "plain ascii"])
def test_byte_by_byte_join_equals_text(text):
    assembler = TextAssembler(["zzz"])
    pieces = [assembler.append(bytes([byte])) for byte in text.encode()]
    pieces.append(assembler.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
