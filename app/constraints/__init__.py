"""Structured output: constraints compiled with llguidance, one matcher per constrained request.

* :mod:`spec`: what a client asked for (``ConstraintSpec``: json, json_schema, regex, choice,
  grammar), wire-neutral and hashable (the compile cache's key).
* :mod:`vocabulary`: the model's vocabulary as llguidance's tokenizer, built once per model.
* :mod:`compiler`: ``ConstraintCompiler``, spec -> ``CompiledConstraint`` (checked, cached).
* :mod:`matcher`: ``ConstraintMatcher``, one request's position in its language: the next
  token mask, advanced by each sampled token.
"""

from app.constraints.compiler import CompiledConstraint, ConstraintCompiler
from app.constraints.matcher import ConstraintMatcher
from app.constraints.spec import ConstraintError, ConstraintKind, ConstraintSpec

__all__ = [
    "CompiledConstraint",
    "ConstraintCompiler",
    "ConstraintError",
    "ConstraintKind",
    "ConstraintSpec",
    "ConstraintMatcher",
]
