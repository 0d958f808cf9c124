"""Constraint specs compiled against one model's vocabulary, with a bounded cache.

``ConstraintCompiler.compile`` is CPU work (a JSON schema's lexer: ~1-50 ms, more for large
schemas) and is called on a worker thread by the request builder, before the request takes a
slot; llguidance drops the GIL while it builds. The result, a ``CompiledConstraint``, holds a
pristine ``llguidance.LLMatcher`` that has consumed nothing: each request's matcher is a
``deep_copy`` of it (microseconds), made when the request is admitted.

The llguidance tokenizer is built on first use (~0.2 s for a 49k vocabulary), so a server that
never sees a constraint never pays for it.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict

import llguidance
import numpy as np

from app.constraints.matcher import ConstraintMatcher
from app.constraints.spec import ConstraintError, ConstraintSpec
from app.constraints.vocabulary import build_ll_tokenizer
from app.models.base import ModelCapabilities, Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 128  # compiled constraints kept (LRU), per model


class CompiledConstraint:
    """A checked constraint: makes a fresh matcher per request (``new_matcher``).

    Shared by every request with the same spec; never advanced itself. Its matchers share
    llguidance's lexer: one that outgrows llguidance's limits (a regex such as
    ``(a{1000}){1000}``, whose states are built as the output goes) leaves every later copy in
    error at once, whose mask allows only EOS. So a matcher's error marks the constraint
    ``broken`` (:meth:`ConstraintMatcher.error`), and the compiler refuses it from then on.

    Attributes:
        spec: what it was compiled from.
        broken: llguidance's error that one of its matchers met, or None.
    """

    __slots__ = ("spec", "broken", "_pristine", "_mask_words")

    def __init__(self, spec: ConstraintSpec, pristine: llguidance.LLMatcher, mask_words: int):
        self.spec = spec
        self.broken: str | None = None
        self._pristine = pristine
        self._mask_words = mask_words

    def new_matcher(self) -> ConstraintMatcher:
        """A matcher at the start of the language, owned by one request."""
        return ConstraintMatcher(self._pristine.deep_copy(), self._mask_words, self._break)

    def _break(self, error: str) -> None:
        self.broken = self.broken or error


class ConstraintCompiler:
    """Compiles specs for one model (its tokenizer adapter built once), caching the results.

    Thread-safe: the cache and the lazily built tokenizer are guarded by one lock; compiles
    themselves run outside it, in parallel.

    Args:
        tokenizer: the model's tokenizer.
        capabilities: the model's vocabulary size (the logits' width) and EOS ids.
        cache_size: compiled constraints kept, least recently used dropped first.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        capabilities: ModelCapabilities,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self._capabilities = capabilities
        self._cache_size = cache_size
        self._cache: OrderedDict[ConstraintSpec, CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None

    @property
    def mask_words(self) -> int:
        """int32 words in one token mask: ``ceil(vocab_size / 32)``."""
        return -(-self._capabilities.vocab_size // 32)

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """The compiled constraint of ``spec`` (from the cache when it was compiled before).

        Raises:
            ConstraintError: the constraint cannot be compiled, or its first token's mask
                cannot be computed, or a request following it met llguidance's limits; the
                message gives llguidance's reason (e.g. ``Unimplemented keys:
                ["dependentSchemas"]``).
        """
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
        if cached is not None:
            if cached.broken is not None:  # (kept: the next request is refused as fast)
                raise ConstraintError(f"the constraint is too complex to follow: {cached.broken}")
            return cached
        compiled = self._compile_uncached(spec)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    @property
    def cached(self) -> int:
        """Compiled constraints in the cache (for tests and metrics)."""
        with self._lock:
            return len(self._cache)

    def _compile_uncached(self, spec: ConstraintSpec) -> CompiledConstraint:
        grammar = spec.grammar_text()
        matcher = llguidance.LLMatcher(self._ll(), grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(_reason(matcher.get_error()))
        # the first token's mask and one step past it, on a copy: a language whose lexer
        # outgrows llguidance's limits there (a regex such as (a{1000}){1000}, at its first
        # character) is refused now, before the request takes a slot; the lexer's states are
        # shared, so the request's own first steps are then ready
        probe = ConstraintMatcher(matcher.deep_copy(), self.mask_words)
        allowed = probe.next_mask().numpy().view(np.uint32)
        words = np.flatnonzero(allowed)
        if not probe.error and words.size:
            word = int(words[0])
            bit = int(allowed[word]) & -int(allowed[word])
            probe.advance(32 * word + bit.bit_length() - 1)
        if probe.error:
            raise ConstraintError(
                f"the constraint is too complex to follow: {_reason(probe.error)}"
            )
        return CompiledConstraint(spec, matcher, self.mask_words)

    def _ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = build_ll_tokenizer(self._tokenizer, self._capabilities)
                logger.info(
                    "constraint vocabulary built for %s (%d tokens)",
                    self._capabilities.name,
                    self._ll_tokenizer.vocab_size,
                )
            return self._ll_tokenizer


def _reason(error: str) -> str:
    """llguidance's error on one line, without its source excerpt (the ``  1 | ...`` lines and
    their ``^`` markers)."""
    lines = [
        line.strip()
        for line in error.strip().splitlines()
        if line.strip() and line.strip() != "^" and not _EXCERPT.match(line)
    ]
    return " ".join(lines) if lines else "the constraint cannot be compiled"


_EXCERPT = re.compile(r"^\s*\d+ \| ")
