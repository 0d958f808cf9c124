"""One line of an OpenAI Batch input file: its envelope checked, its body left to the endpoint.

A line is ``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body":
{...}}``. What makes the line itself unusable is refused here, as that line's error (OpenAI's
per-line ``error`` object, with the line number and the field): a line that is not JSON or not
an object, longer than the limit, without a ``custom_id`` string or with one an earlier line
used, a ``method`` other than POST, a ``url`` that is not a batch endpoint, no ``body``, or
``"stream": true`` (a batch answer is one JSON body). Everything about the body is the
endpoint's to judge (``app.batch.endpoints``), so its answer, error or not, is the HTTP
endpoint's own. Blank lines are skipped, as vLLM's ``run-batch`` skips them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.batch.reader import InputLine, OverlongLine

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
BATCH_URLS = (COMPLETIONS_URL, CHAT_COMPLETIONS_URL)
# A line may be this much longer than the largest body: its custom_id, method and url.
ENVELOPE_BYTES = 4096


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """A line whose envelope is fine: its body goes to the endpoint at ``url``.

    Attributes:
        line: the input line number (1-based).
        custom_id: the client's id of the request.
        url: one of ``BATCH_URLS``.
        body: the body as JSON text (UTF-8), as a client would POST it.
    """

    line: int
    custom_id: str
    url: str
    body: bytes


@dataclass(frozen=True, slots=True)
class LineError:
    """A line that could not be run. Written as the output line's ``error``: OpenAI's
    ``{code, message}``, with ``line`` and ``param`` as in its batch validation errors.

    Attributes:
        line: the input line number (1-based).
        custom_id: the line's ``custom_id`` when it has a string one, else None.
        code: what is wrong, e.g. ``invalid_json``, ``duplicate_custom_id``, ``invalid_url``.
        message: a sentence naming the line.
        param: the field at fault (``custom_id``, ``url``, ``body.stream``...), or None.
    """

    line: int
    custom_id: str | None
    code: str
    message: str
    param: str | None = None


def max_line_bytes(max_body_bytes: int) -> int:
    """The longest line read: the server's body limit and room for the envelope."""
    return max_body_bytes + ENVELOPE_BYTES


class LineParser:
    """Checks each line's envelope, in input order; owns the ``custom_id`` s seen so far (one
    string each, for the whole run: the price of refusing duplicates).

    Args:
        max_body_bytes: the server's body limit (a line's limit is ``max_line_bytes`` of it).
    """

    def __init__(self, max_body_bytes: int) -> None:
        self._max_line_bytes = max_line_bytes(max_body_bytes)
        self._seen: set[str] = set()

    def parse(self, raw: InputLine | OverlongLine) -> BatchRequest | LineError:
        """The line's request, or why it cannot be run (see the module doc)."""
        if isinstance(raw, OverlongLine):
            return LineError(
                raw.number,
                None,
                "line_too_long",
                f"line {raw.number} is {raw.size} bytes; the limit is {self._max_line_bytes} "
                "(--max-body-bytes and room for the envelope)",
            )
        number = raw.number
        try:
            line = json.loads(raw.data)
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, absurd nesting
            return LineError(number, None, "invalid_json", f"line {number} is not JSON: {exc}")
        if not isinstance(line, dict):
            message = f"line {number} is not a JSON object"
            return LineError(number, None, "invalid_json", message)
        custom_id = line.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return LineError(
                number,
                None,
                "missing_custom_id" if custom_id is None else "invalid_custom_id",
                f"line {number}: custom_id must be a non-empty string",
                "custom_id",
            )
        if custom_id in self._seen:
            return LineError(
                number,
                custom_id,
                "duplicate_custom_id",
                f"line {number}: custom_id {custom_id!r} was used by an earlier line",
                "custom_id",
            )
        self._seen.add(custom_id)
        return self._request(number, custom_id, line)

    def _request(self, number: int, custom_id: str, line: dict) -> BatchRequest | LineError:
        method = line.get("method")
        if method != "POST":
            return LineError(
                number,
                custom_id,
                "invalid_method",
                f"line {number}: method must be 'POST', not {method!r}",
                "method",
            )
        url = line.get("url")
        if url not in BATCH_URLS:
            return LineError(
                number,
                custom_id,
                "invalid_url",
                f"line {number}: url {url!r} is not one of {', '.join(BATCH_URLS)}",
                "url",
            )
        if "body" not in line:
            message = f"line {number}: the request has no body"
            return LineError(number, custom_id, "missing_body", message, "body")
        body = line["body"]
        if isinstance(body, dict) and body.get("stream") is True:
            return LineError(
                number,
                custom_id,
                "stream_unsupported",
                f"line {number}: a batch answer is one JSON body; stream must be false",
                "body.stream",
            )
        return BatchRequest(number, custom_id, url, _json_bytes(body))


def _json_bytes(value: object) -> bytes:
    """``value`` as compact JSON, as a client would send it; a string holding a lone
    surrogate (a ``\\ud800`` escape) stays an escape."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":")).encode()
