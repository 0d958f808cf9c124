"""One line's envelope: what makes a line unusable is that line's error, with its line number,
its custom_id when it has one, and the field at fault; the body is left to the endpoint."""

from __future__ import annotations

import json

import pytest

from app.batch.reader import InputLine, OverlongLine
from app.batch.requests import BatchRequest, LineError, LineParser, max_line_bytes
from tests.batch.conftest import batch_line


def parse(parser: LineParser, text: str | bytes, number: int = 1) -> BatchRequest | LineError:
    data = text.encode() if isinstance(text, str) else text
    return parser.parse(InputLine(number, data))


def test_a_good_line_keeps_its_id_url_and_body_as_json():
    body = {"prompt": "héllo", "max_tokens": 3, "stop": ["\n"]}
    request = parse(LineParser(1024), batch_line("req-1", body), number=7)
    assert isinstance(request, BatchRequest)
    assert (request.line, request.custom_id, request.url) == (7, "req-1", "/v1/completions")
    assert json.loads(request.body) == body
    assert "héllo".encode() in request.body  # compact UTF-8, as a client sends it


@pytest.mark.parametrize(
    ("line", "code", "param", "custom_id"),
    [
        ("not json", "invalid_json", None, None),
        (b'{"custom_id": "\xff"}', "invalid_json", None, None),  # not UTF-8
        ('["a list"]', "invalid_json", None, None),
        ("[" * 100_000 + "]" * 100_000, "invalid_json", None, None),  # too deep to parse
        (
            '{"method": "POST", "url": "/v1/completions", "body": {}}',
            "missing_custom_id",
            "custom_id",
            None,
        ),
        ('{"custom_id": 5, "method": "POST"}', "invalid_custom_id", "custom_id", None),
        ('{"custom_id": "", "method": "POST"}', "invalid_custom_id", "custom_id", None),
        (
            '{"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}',
            "invalid_method",
            "method",
            "x",
        ),
        (
            '{"custom_id": "x", "url": "/v1/completions", "body": {}}',
            "invalid_method",
            "method",
            "x",
        ),
        (
            '{"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}',
            "invalid_url",
            "url",
            "x",
        ),
        (
            '{"custom_id": "x", "method": "POST", "url": "/v1/completions"}',
            "missing_body",
            "body",
            "x",
        ),
        (
            batch_line("x", {"prompt": "p", "stream": True}),
            "stream_unsupported",
            "body.stream",
            "x",
        ),
    ],
)
def test_a_bad_envelope_is_that_lines_error(line, code, param, custom_id):
    error = parse(LineParser(1024), line, number=3)
    assert isinstance(error, LineError), error
    assert (error.line, error.code, error.param, error.custom_id) == (3, code, param, custom_id)
    assert error.message.startswith("line 3")


def test_a_body_the_endpoint_must_judge_is_not_judged_here():
    parser = LineParser(1024)
    for custom_id, body in [("a", {"prompt": "p", "stream": "yes"}), ("b", [1]), ("c", None)]:
        assert isinstance(parse(parser, batch_line(custom_id, body)), BatchRequest)


def test_a_custom_id_is_used_once():
    parser = LineParser(1024)
    assert isinstance(parse(parser, batch_line("same", {"prompt": "a"}), 1), BatchRequest)
    duplicate = parse(parser, batch_line("same", {"prompt": "b"}), 2)
    assert isinstance(duplicate, LineError) and duplicate.code == "duplicate_custom_id"
    assert duplicate.custom_id == "same" and "line 2" in duplicate.message
    # a line refused for another reason still claims its id
    parse(parser, '{"custom_id": "taken", "method": "PUT"}', 3)
    again = parse(parser, batch_line("taken", {"prompt": "c"}), 4)
    assert isinstance(again, LineError) and again.code == "duplicate_custom_id"


def test_an_overlong_line_names_the_limit():
    error = LineParser(1000).parse(OverlongLine(9, 123_456))
    assert isinstance(error, LineError) and error.code == "line_too_long"
    assert "123456 bytes" in error.message and str(max_line_bytes(1000)) in error.message


def test_a_lone_surrogate_in_the_body_stays_an_escape():
    request = parse(
        LineParser(1024),
        '{"custom_id": "s", "method": "POST", '
        '"url": "/v1/completions", "body": {"prompt": "\\ud800"}}',
    )
    assert isinstance(request, BatchRequest) and b"\\ud800" in request.body
