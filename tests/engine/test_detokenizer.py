"""TextAssembler: UTF-8 safety and stop strings."""

from __future__ import annotations

import random

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


@pytest.mark.parametrize("seed", range(40))
def test_released_text_is_the_output_cut_at_the_earliest_stop(seed):
    """Random valid UTF-8 split at random byte boundaries, one stop string: what is released,
    then flushed, is the whole text cut where the stop string first occurs; at every token the
    released text is a prefix of it, and what is held back is shorter than the stop string (a
    part of a character aside: it is not text yet). (With one stop string its first
    occurrence is also the first to complete, whatever the token boundaries.)"""
    generator = random.Random(seed)
    alphabet = "ab<>/ eé中😀"
    text = "".join(generator.choice(alphabet) for _ in range(generator.randint(0, 300)))
    stop = "</a>" if seed % 2 else ""
    stop = stop or "".join(generator.choice(alphabet) for _ in range(generator.randint(1, 4)))
    stops = [stop]
    cuts = [text.find(stop)] if stop in text else []
    expected = text[: cuts[0]] if cuts else text
    data = text.encode()
    assembler = TextAssembler(stops)
    released, position = "", 0
    while position < len(data) and assembler.matched_stop is None:
        size = generator.randint(1, 5)
        released += assembler.append(data[position : position + size])
        position += size
        assert expected.startswith(released)
        assert len(assembler.text) - len(released) < max(map(len, stops))
    if assembler.matched_stop is None:
        released += assembler.flush()
    assert released == expected == assembler.text
    assert (assembler.matched_stop is not None) == bool(cuts)
