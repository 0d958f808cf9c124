"""API keys: ``Authorization: Bearer KEY`` (or Anthropic's ``x-api-key: KEY``) on every endpoint
but ``/health`` when keys are set.

Keys are compared in constant time (``hmac.compare_digest``) against every configured key.
A request's *owner* is a digest of the key it used, so that a DELETE can only cancel requests
made with the same key; the key itself is never stored on a request.
"""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from app.api.errors import APIError


class ApiKeyGuard:
    """Checks bearer keys.

    Args:
        keys: accepted keys; empty means no key is required (every owner is None).
    """

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = tuple(key.encode("utf-8") for key in keys if key)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @classmethod
    def from_setting(cls, value: str | None) -> ApiKeyGuard:
        """``value`` holds one key or several separated by commas."""
        if not value:
            return cls(())
        return cls(tuple(part.strip() for part in value.split(",") if part.strip()))

    def owner_of(self, request: Request) -> str | None:
        """Returns the caller's owner tag (None when keys are off).

        Raises:
            APIError: 401 ``unauthorized`` when keys are on and the request has none that match.
        """
        if not self._keys:
            return None
        presented = _presented_key(request)
        presented_bytes = (presented or "").encode("utf-8")
        matched = False
        for key in self._keys:
            # no early exit: every key is compared, so timing does not tell which one matched
            matched |= hmac.compare_digest(presented_bytes, key)
        if presented is None or not matched:
            raise APIError(
                401,
                "unauthorized",
                "missing or invalid API key (send 'Authorization: Bearer KEY')",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return hashlib.sha256(presented_bytes).hexdigest()[:32]


def _presented_key(request: Request) -> str | None:
    """The key a request sent: ``Authorization: Bearer KEY``, else Anthropic's
    ``x-api-key: KEY`` (its SDKs send that); None when it sent neither."""
    scheme, _, presented = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return presented.strip()
    api_key = request.headers.get("x-api-key")
    return None if api_key is None else api_key.strip()
