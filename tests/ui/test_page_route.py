"""``GET /`` and ``GET /ui`` over the ASGI transport: the bytes, the headers, ``--no-ui``."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

import pytest

from app.api.ui import PAGE
from app.config import ServerConfig
from tests.http.conftest import app_client, mock_config

PAGE_FILE = Path(__file__).resolve().parents[2] / "app" / "api" / "static" / "chat.html"
PAGE_SIZE_LIMIT = 48 * 1024  # "small": the page is one file of markup, style and script


def csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


@pytest.mark.parametrize("path", ["/", "/ui"])
async def test_serves_the_page_file(path):
    async with app_client() as client:
        response = await client.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert response.content == PAGE_FILE.read_bytes()
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["x-request-id"]


async def test_page_is_small_and_self_contained():
    text = PAGE_FILE.read_text(encoding="utf-8")
    assert len(PAGE_FILE.read_bytes()) < PAGE_SIZE_LIMIT
    # no URL of another host: no scheme://, no protocol-relative //host, no @import or url()
    assert re.findall(r"[A-Za-z][A-Za-z0-9+.-]*://", text) == []
    assert re.findall(r"(?<![:/\w])//(?=[A-Za-z0-9.-]+[./:][A-Za-z0-9])", text) == []
    assert "@import" not in text and "url(" not in text
    markup = re.sub(r"<script>.*?</script>", "", text, flags=re.DOTALL)
    for attribute in re.findall(r"""\b(?:src|href|action)\s*=\s*["']?([^"'\s>]*)""", markup):
        assert attribute.startswith("data:"), attribute
    # the page's fetches are relative to where it is served
    assert set(re.findall(r"""fetch\(\s*["']([^"']*)""", text)) == {
        "v1/models",
        "v1/chat/completions",
        "generate/",
        "metrics",
    }


def test_model_output_never_becomes_markup():
    """The page builds model output as DOM nodes with textContent: no HTML-parsing sink."""
    text = PAGE_FILE.read_text(encoding="utf-8")
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function", "DOMParser", "createContextualFragment", "srcdoc"):  # fmt: skip
        assert sink not in text, sink


async def test_content_security_policy_allows_only_the_inline_script_and_style():
    text = PAGE_FILE.read_text(encoding="utf-8")
    (script,) = re.findall(r"<script>(.*?)</script>", text, flags=re.DOTALL)
    (style,) = re.findall(r"<style>(.*?)</style>", text, flags=re.DOTALL)
    async with app_client() as client:
        policy = (await client.get("/")).headers["content-security-policy"]
    directives = dict(part.strip().split(" ", 1) for part in policy.split(";"))
    assert directives["default-src"] == "'none'"
    assert directives["script-src"] == csp_hash(script)
    assert directives["style-src"] == csp_hash(style)
    assert directives["connect-src"] == "'self'"
    assert directives["frame-ancestors"] == "'none'"


async def test_etag_revalidation_and_head():
    async with app_client() as client:
        first = await client.get("/")
        etag = first.headers["etag"]
        assert etag == PAGE.etag
        again = await client.get("/", headers={"If-None-Match": etag})
        assert again.status_code == 304 and again.content == b""
        assert again.headers["etag"] == etag
        stale = await client.get("/", headers={"If-None-Match": '"0000000000000000"'})
        assert stale.status_code == 200 and stale.content == first.content
        head = await client.head("/ui")
    assert head.status_code == 200
    assert head.headers["content-length"] == str(len(first.content))


async def test_no_ui_is_a_404_and_leaves_the_docs_alone():
    async with app_client(mock_config(ui=False)) as client:
        for path in ("/", "/ui"):
            response = await client.get(path)
            assert response.status_code == 404
            assert response.json()["error"]["type"] == "not_found"
        assert (await client.get("/docs")).status_code == 200
        assert (await client.get("/openapi.json")).status_code == 200
        assert (await client.get("/health")).status_code == 200


async def test_the_page_is_no_api_operation():
    async with app_client() as client:
        assert (await client.get("/docs")).status_code == 200
        paths = (await client.get("/openapi.json")).json()["paths"]
    assert "/" not in paths and "/ui" not in paths


async def test_with_an_api_key_the_page_loads_but_what_it_calls_needs_the_key():
    async with app_client(mock_config(api_key="k1")) as client:
        page = await client.get("/")
        assert page.status_code == 200 and page.content == PAGE_FILE.read_bytes()
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/v1/models")).status_code == 401
        keyed = {"Authorization": "Bearer k1"}
        assert (await client.get("/metrics", headers=keyed)).status_code == 200


def test_no_ui_flag_and_env():
    assert ServerConfig().ui is True
    assert ServerConfig(_cli_parse_args=["--no-ui"]).ui is False
    assert ServerConfig(_cli_parse_args=["--ui"]).ui is True


def test_no_ui_from_the_environment(monkeypatch):
    monkeypatch.setenv("SLOTSERVE_UI", "false")
    assert ServerConfig().ui is False
