"""What ends a sequence once a token is appended to it (vLLM's stop checks), as one record.

The scheduler appends a token, then asks, in this order: does the token end the sequence by
itself (:func:`token_ending`: outside its constraint, a stop token id, EOS)? did its text
match a stop string or fail to decode (:func:`text_ending`, from the text side's outcome)?
has it reached a limit (:func:`limit_ending`: the constraint's language complete, its
``max_tokens``, the context)? The first :class:`Ending` found goes to ``Scheduler.finish``.
"""

from __future__ import annotations

import logging
from collections.abc import Set
from dataclasses import dataclass

from app.engine.output_processor import TextOutcome
from app.engine.request import FinishReason, Sequence

logger = logging.getLogger(__name__)

UNDECODABLE = "failed to decode generated tokens"
LEFT_CONSTRAINT = "the output left the request's constraint"


@dataclass(frozen=True, slots=True)
class Ending:
    """Why a sequence ends (rule R05).

    Attributes:
        reason: its finish reason.
        stop_reason: the stop string or stop token id matched (STOP only), else None.
        error: a client-safe message (ERROR only), else None.
        last_token_has_text: False when the last token ends it by itself: it goes out with
            the final event (its id, logprobs and usage), never as text.
    """

    reason: FinishReason
    stop_reason: str | int | None = None
    error: str | None = None
    last_token_has_text: bool = True


_EOS = Ending(FinishReason.STOP, last_token_has_text=False)
_LEFT_CONSTRAINT = Ending(FinishReason.ERROR, error=LEFT_CONSTRAINT, last_token_has_text=False)
_UNDECODABLE = Ending(FinishReason.ERROR, error=UNDECODABLE)
_LANGUAGE_COMPLETE = Ending(FinishReason.STOP)
_LENGTH = Ending(FinishReason.LENGTH)


def token_ending(seq: Sequence, token: int, eos_token_ids: Set[int]) -> Ending | None:
    """How ``token``, just appended, ends ``seq`` by itself; None when it does not.

    Side effect: advances ``seq``'s constraint matcher by ``token`` (a token it refuses
    ends the sequence with an error, logged).
    """
    stop = seq.request.stop
    if seq.matcher is not None and not seq.matcher.advance(token):
        reason = seq.matcher.error  # (llguidance's limits met, or a mask not applied)
        logger.error(
            "request %s: token %d is outside its constraint (%s)",
            seq.request_id,
            token,
            reason or "the mask was not applied",
        )
        if not reason:
            return _LEFT_CONSTRAINT
        return Ending(
            FinishReason.ERROR, error=f"{LEFT_CONSTRAINT} ({reason})", last_token_has_text=False
        )
    if token in stop.stop_token_ids:
        return Ending(FinishReason.STOP, stop_reason=token, last_token_has_text=False)
    if not stop.ignore_eos and token in eos_token_ids:
        return _EOS
    return None


def text_ending(seq: Sequence, outcome: TextOutcome) -> Ending | None:
    """How the text side's ``outcome`` over ``seq``'s tokens ends it: a stop string matched
    (STOP, the string as stop reason), a token that failed to decode (ERROR); None for
    ``TEXTED``."""
    if outcome is TextOutcome.STOP_STRING:
        return Ending(FinishReason.STOP, stop_reason=seq.output.text.matched_stop)
    if outcome is TextOutcome.UNDECODABLE:
        return _UNDECODABLE
    return None


def limit_ending(seq: Sequence, context_length: int) -> Ending | None:
    """How ``seq`` ends at a limit: its constraint's language allows no further token (STOP),
    it has ``max_tokens`` tokens or fills the context (LENGTH); None otherwise."""
    if seq.matcher is not None and seq.matcher.is_finished:
        return _LANGUAGE_COMPLETE
    if (
        len(seq.generated) >= seq.request.max_tokens
        or seq.num_prompt_tokens + len(seq.generated) >= context_length
    ):
        return _LENGTH
    return None
