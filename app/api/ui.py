"""``GET /`` and ``GET /ui``: the chat page, one self-contained HTML file shipped in the package.

The page (``app/api/static/chat.html``: markup, style and script in one file, no build step, no
URL outside the server it came from) chats over ``POST /v1/chat/completions`` streaming, stops an
answer with ``DELETE /generate/{id}``, and polls ``GET /metrics`` for its live panel. It holds no
server data, so it is served without an API key, also under ``--api-key``: the page itself asks
for the key, keeps it in the tab's ``sessionStorage`` and sends it as ``Authorization: Bearer``
on every call it makes. ``--no-ui`` leaves these routes out (404); ``/docs`` and
``/openapi.json`` are not affected either way.

The answer carries a Content-Security-Policy that lets the browser run only the page's own inline
script and style (by their SHA-256, computed here when the module is imported) and connect only
to the origin it came from: even if model output ever reached the DOM as markup, no script in it
would run and nothing would be fetched from elsewhere. The page builds model output with
``textContent`` only, so that is a second line of defence, not the first.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from importlib import resources

from fastapi import APIRouter, Request, Response

PAGE_RESOURCE = ("static", "chat.html")
PAGE_MEDIA_TYPE = "text/html; charset=utf-8"

_INLINE_BLOCK = r"<{tag}>(.*?)</{tag}>"


@dataclass(frozen=True, slots=True)
class Page:
    """The served bytes and the headers that go with them.

    Attributes:
        body: the HTML file as shipped (UTF-8).
        etag: a strong validator of ``body`` (quoted, 16 hex digits of its SHA-256).
        content_security_policy: the policy described in the module doc.
    """

    body: bytes
    etag: str
    content_security_policy: str

    @classmethod
    def load(cls) -> Page:
        """Reads the page from the package.

        Raises:
            ValueError: the page has no inline ``<script>`` (nothing for the policy to allow).
        """
        body = resources.files("app.api").joinpath(*PAGE_RESOURCE).read_bytes()
        text = body.decode("utf-8")
        scripts = _inline_hashes(text, "script")
        if not scripts:
            raise ValueError(f"{'/'.join(PAGE_RESOURCE)} has no inline <script>")
        policy = "; ".join(
            (
                "default-src 'none'",
                "script-src " + " ".join(scripts),
                "style-src " + (" ".join(_inline_hashes(text, "style")) or "'none'"),
                "connect-src 'self'",
                "img-src 'self' data:",
                "base-uri 'none'",
                "form-action 'none'",
                "frame-ancestors 'none'",
            )
        )
        etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
        return cls(body=body, etag=etag, content_security_policy=policy)

    def headers(self) -> dict[str, str]:
        return {
            "Content-Security-Policy": self.content_security_policy,
            "ETag": self.etag,
            # revalidate every load (a 304 when unchanged), so an upgraded server shows its page
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        }


def _inline_hashes(text: str, tag: str) -> list[str]:
    """CSP source expressions (``'sha256-...'``) of every inline ``<tag>`` block's content.

    Browsers hash the element's text after the HTML parser has normalised line ends to LF
    (CSP level 3, "Does element match source list"), so the same is done here.
    """
    blocks = re.findall(_INLINE_BLOCK.format(tag=tag), text, flags=re.DOTALL)
    hashes = []
    for block in blocks:
        normalised = block.replace("\r\n", "\n").replace("\r", "\n")
        digest = hashlib.sha256(normalised.encode("utf-8")).digest()
        hashes.append("'sha256-" + base64.b64encode(digest).decode("ascii") + "'")
    return hashes


PAGE = Page.load()

router = APIRouter(include_in_schema=False)


async def chat_page(request: Request) -> Response:
    """The page, or 304 when the browser's copy (``If-None-Match``) is current."""
    headers = PAGE.headers()
    if PAGE.etag in _etags(request.headers.get("if-none-match", "")):
        return Response(status_code=304, headers=headers)
    # HEAD: the server sends the headers of this answer (Content-Length included), no body
    return Response(PAGE.body, media_type=PAGE_MEDIA_TYPE, headers=headers)


def _etags(header: str) -> set[str]:
    """The entity tags of an ``If-None-Match`` header (weak ones compared by their value)."""
    if header.strip() == "*":
        return {PAGE.etag}
    return {tag.strip().removeprefix("W/") for tag in header.split(",") if tag.strip()}


for _path in ("/", "/ui"):
    router.add_api_route(_path, chat_page, methods=["GET", "HEAD"])
