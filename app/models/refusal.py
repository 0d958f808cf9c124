"""Why a model cannot be served: the two exceptions every reader and the loader raise.

A reader raises :class:`UnsupportedModel` with the reason alone; the loader, which knows the
path the user gave, turns it into :class:`ModelRefused`, whose message is the one line the
command line prints before it exits with status 2 (``app/__main__.py``).
"""

from __future__ import annotations

from pathlib import Path


class UnsupportedModel(ValueError):
    """A file this server cannot serve; the message is the reason, one line, for the user."""


def whole_number(what: str, value: object) -> int:
    """``value`` (a metadata field, named ``what`` in the refusal) as an int: an int, or a
    float without a fraction (JSON and GGUF writers store both).

    Raises:
        UnsupportedModel: another type (a string, a list, a bool), or a fraction.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnsupportedModel(f"{what} is {value!r}, not a whole number")
    if isinstance(value, float) and not value.is_integer():
        raise UnsupportedModel(f"{what} is {value!r}, not a whole number")
    return int(value)


class ModelRefused(Exception):
    """The model the user named cannot be served.

    Attributes:
        path: what the user gave (``--model``), or the file it resolved to.
        reason: one line, e.g. ``"unsupported architecture 'phi3' (supported: ...)"``.
    """

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason
