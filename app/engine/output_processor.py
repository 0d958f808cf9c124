"""The text side of generated tokens: detokenizing, stop strings, the ``TokenEvent``s a
request's stream gets, and the token-latency histograms (vLLM v1's output processor,
mini-sglang's detokenizer: both outside the scheduler).

The scheduler appends tokens to ``Sequence.generated`` and decides when a sequence ends; it
tells :class:`OutputProcessor` of each token appended, and ends a sequence on what the text
side reports back (:class:`TextOutcome`: a stop string matched, a token that failed to decode).
Each request's own part (its text, how far the text side and its stream got, its stream, its
token times) is its :class:`RequestOutput`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from collections.abc import Sequence as Tokens

from app.engine.detokenizer import TextAssembler
from app.engine.metrics import EngineMetrics
from app.engine.request import GenerationRequest, Sequence, StreamEvent, TokenEvent
from app.models.base import Tokenizer, TokenLogprobs

logger = logging.getLogger(__name__)


class TextOutcome(enum.Enum):
    """How the text side ended over a request's new tokens (rule R06)."""

    TEXTED = "texted"
    """Every new token went through it (or there was none, or its text had ended before)."""
    STOP_STRING = "stop_string"
    """A stop string matched (``RequestOutput.text.matched_stop``): the request ends (STOP);
    the tokens after the one that matched get no text and no event."""
    UNDECODABLE = "undecodable"
    """A token's bytes failed to decode (logged): the request ends (ERROR); the tokens after
    it get no text and no event."""


class RequestOutput:
    """One request's output side: its text, its stream, and how far both got.

    The tokens and their logprobs are the ``Sequence``'s (``generated``, ``logprobs``: one
    entry a token when the request asks for logprobs, none otherwise); this keeps two indexes
    into them, so what is held back is derived, never copied:

    * ``[0, num_sent)``: carried by ``TokenEvent``s already;
    * ``[num_sent, num_texted)``: through the text side, their text held back (an unfinished
      UTF-8 character, a possible stop string) or none (a token that ends the request);
    * ``[num_texted, len(generated))``: not through the text side yet.

    Args:
        request: the request (its id for logs, its stop strings).
        emit: where its events go (``RequestHandle.push``); never blocks.

    Attributes:
        emit: as given.
        text: the output text (UTF-8 safe, stop-string aware).
        first_token_at / last_token_at: when its first and its latest token were appended
            (``time.perf_counter()`` seconds), None until then; ``OutputProcessor`` sets them.
    """

    __slots__ = (
        "_request_id",
        "emit",
        "text",
        "first_token_at",
        "last_token_at",
        "_num_texted",
        "_num_sent",
        "_text_over",
    )

    def __init__(self, request: GenerationRequest, emit: Callable[[StreamEvent], None]) -> None:
        self._request_id = request.request_id
        self.emit = emit
        self.text = TextAssembler(request.stop.stop_strings)
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._num_texted = 0
        self._num_sent = 0
        self._text_over = False  # a stop string matched or a token failed to decode

    def num_untexted(self, num_generated: int) -> int:
        """Tokens of ``num_generated`` the text side has not run over."""
        return num_generated - self._num_texted

    def run_text(
        self,
        generated: Tokens[int],
        logprobs: Tokens[TokenLogprobs],
        decode_bytes: Callable[[Tokens[int]], bytes],
        *,
        last_has_text: bool = True,
    ) -> TextOutcome:
        """Runs the text side over ``generated[num_texted:]``, oldest first, as if each token
        had just been generated: its text appended, a ``TokenEvent`` for whatever text became
        safe to send (with every token and logprob since the last event).

        Args:
            generated / logprobs: the sequence's tokens and their logprobs, whole.
            decode_bytes: the tokenizer's ``decode_bytes``.
            last_has_text: False when the last token ends the request without text (a stop
                token id, EOS, a token outside the constraint): it joins the next event's
                ids, never the text.
        """
        end = len(generated)
        if self._num_texted >= end or self._text_over:
            return TextOutcome.TEXTED
        text = self.text
        while self._num_texted < end:
            index = self._num_texted
            self._num_texted = index + 1
            if index == end - 1 and not last_has_text:
                break
            token = generated[index]
            try:
                new_text = text.append(decode_bytes((token,)))
            except Exception:
                logger.exception("request %s: decoding token %d failed", self._request_id, token)
                self._text_over = True
                return TextOutcome.UNDECODABLE
            if new_text:  # the tokens since the last event go with it (one, mostly)
                start = self._num_sent
                ids = (token,) if start == index else tuple(generated[start : index + 1])
                entries = tuple(logprobs[start : index + 1]) if logprobs else ()
                self.emit(TokenEvent(new_text, ids, entries))
                self._num_sent = index + 1
            if text.matched_stop is not None:
                self._text_over = True
                return TextOutcome.STOP_STRING
        return TextOutcome.TEXTED

    def send_rest(self, generated: Tokens[int], logprobs: Tokens[TokenLogprobs]) -> None:
        """At the end: one last ``TokenEvent`` with the text held back and the tokens not yet
        carried, when there is any of either."""
        tail = self.text.flush()
        if tail or self._num_sent < self._num_texted:
            self._send(tail, generated, logprobs)

    def _send(self, text: str, generated: Tokens[int], logprobs: Tokens[TokenLogprobs]) -> None:
        start, end = self._num_sent, self._num_texted
        self.emit(TokenEvent(text, tuple(generated[start:end]), tuple(logprobs[start:end])))
        self._num_sent = end


class OutputProcessor:
    """The engine's text side over every request's ``RequestOutput``: which sequences have
    tokens due for text, and the token latencies until they are observed.

    The scheduler calls :meth:`token_appended` for each token it appends; the text of
    those tokens goes out at :meth:`emit_due` (the engine runs it while the next step
    runs), or at once through :meth:`run_text` (a request with stop strings, a finish).

    Args:
        tokenizer: turns token ids into bytes.
        metrics: where the time-to-first-token and inter-token histograms go.
    """

    def __init__(self, tokenizer: Tokenizer, metrics: EngineMetrics) -> None:
        self._tokenizer = tokenizer
        self._metrics = metrics
        # from one step's tokens to the emit_due after it: the sequences with tokens due for
        # text (in the order they got them), and the latencies of those tokens, in seconds
        self._due: list[Sequence] = []
        self._first_token_latencies: list[float] = []
        self._inter_token_latencies: list[float] = []
        # those whose text failed to decode while a step was in flight: ended after it
        self._undecodable: list[Sequence] = []

    def token_appended(self, seq: Sequence, now: float) -> None:
        """``seq.generated`` got a token at ``now`` (seconds): its latency is taken, and
        ``seq`` is due for text if it was not already."""
        output = seq.output
        last = output.last_token_at
        if last is None:
            self._first_token_latencies.append(now - seq.request.arrived_at)
            output.first_token_at = now
        else:
            self._inter_token_latencies.append(now - last)
        output.last_token_at = now
        # a request with stop strings has its text run at once (``run_text``), never due
        if output.num_untexted(len(seq.generated)) == 1 and not seq.request.stop.stop_strings:
            self._due.append(seq)

    def run_text(self, seq: Sequence, *, last_has_text: bool = True) -> TextOutcome:
        """``RequestOutput.run_text`` over ``seq``'s new tokens, now."""
        return seq.output.run_text(
            seq.generated, seq.logprobs, self._tokenizer.decode_bytes, last_has_text=last_has_text
        )

    def emit_due(self, *, step_in_flight: bool) -> list[Sequence]:
        """Runs the text side of every sequence with tokens due, and observes the latencies
        taken since the last call.

        Returns:
            The sequences to end now because a token's text failed to decode
            (``TextOutcome.UNDECODABLE``; ERROR). While a step is in flight (it may still
            use their slots) none: they are kept for :meth:`take_undecodable`.
        """
        due, self._due = self._due, []
        decode_bytes = self._tokenizer.decode_bytes
        failed = []
        for seq in due:
            outcome = seq.output.run_text(seq.generated, seq.logprobs, decode_bytes)
            if outcome is not TextOutcome.TEXTED:
                failed.append(seq)
        first_token, self._first_token_latencies = self._first_token_latencies, []
        between, self._inter_token_latencies = self._inter_token_latencies, []
        for seconds in first_token:
            self._metrics.time_to_first_token.observe(seconds)
        for seconds in between:
            self._metrics.inter_token_latency.observe(seconds)
        if step_in_flight:
            self._undecodable.extend(failed)
            return []
        return failed

    def take_undecodable(self) -> list[Sequence]:
        """The sequences :meth:`emit_due` kept while a step was in flight (the caller ends
        them, ERROR, once that step returned)."""
        undecodable, self._undecodable = self._undecodable, []
        return undecodable
