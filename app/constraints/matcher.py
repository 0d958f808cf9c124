"""One constrained request's position in its language (an ``llguidance.LLMatcher``).

Owned by the request's ``Sequence`` from admission to the finish funnel: the scheduler asks it
for the mask of the next token before each sampling step (``next_mask``) and advances it with
the token sampled (``advance``). Nothing else touches it, and it is dropped when the sequence
finishes, so a reused slot never sees another request's matcher.
"""

from __future__ import annotations

from collections.abc import Callable

import llguidance
import llguidance.numpy
import numpy as np
import torch

# How llguidance's error begins when the grammar rejects a consumed token.
_REJECTED = "Parser Error: token"


class ConstraintMatcher:
    """Masks and advances one request's constraint.

    Args:
        matcher: a fresh llguidance matcher (consumed nothing), owned from now on.
        mask_words: int32 words per mask (``ceil(vocab_size / 32)`` of the model's logits).
        on_error: called with llguidance's error the first time the matcher is found in
            error (its compiled constraint marks itself broken).
    """

    __slots__ = ("_matcher", "_mask_words", "_on_error")

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        mask_words: int,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self._matcher = matcher
        self._mask_words = mask_words
        self._on_error = on_error

    def next_mask(self) -> torch.Tensor:
        """The allowed next tokens: int32 ``[mask_words]``, llguidance's bitmask layout (bit
        ``j`` of word ``w`` allows token ``32 * w + j``); EOS is allowed where the language may
        end. A new tensor each call (the step that reads it may still run when the next one is
        computed).

        Filled through ``llguidance.numpy`` and shared with torch without a copy:
        ``llguidance.torch`` does the same fill, but importing it compiles a ``torch.compile``
        kernel never called here (it loads ``torch._dynamo`` and ``torch._inductor``: ~5 s of
        CPU at the start of every server process)."""
        mask = np.empty((1, self._mask_words), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask(self._matcher, mask)
        self._tell_error()
        return torch.from_numpy(mask[0])

    def advance(self, token_id: int) -> bool:
        """Consumes the sampled token. False when the token is outside the language (the mask
        was not applied, or the matcher is in error): the request cannot go on."""
        consumed = self._matcher.consume_token(token_id)
        self._tell_error()
        return consumed

    @property
    def is_finished(self) -> bool:
        """The language allows no further token (the output is complete); never for a
        matcher in error (its mask then allows EOS alone, which completes nothing)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str:
        """The first line of llguidance's error ("" when none: the matcher follows its
        language; the lines after it dump the parser's state)."""
        error = self._matcher.get_error() if self._matcher.is_error() else ""
        return error.strip().splitlines()[0].strip() if error.strip() else ""

    def _tell_error(self) -> None:
        """A matcher found in error after a mask or a step (llguidance's limits met, such as
        a lexer grown past them) tells its compiled constraint once, unless the grammar
        rejected a token (the engine's mask not applied: that request's failure alone)."""
        if self._on_error is None:
            return
        error = self.error
        if error and not error.startswith(_REJECTED):
            self._on_error(error)
            self._on_error = None
