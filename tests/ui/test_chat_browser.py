"""The chat page in a real browser (headless Chromium) against a live server on 127.0.0.1.

The server runs ``ScriptedChatModel`` (tests/ui/scripted_model.py) through ``create_app``: a
byte-level model that answers with seeded words, streams without end on request, or says an
exact text (markup included), one byte a model step.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ui.chat_page import ChatPage
from tests.ui.conftest import record_artifact, wait_until
from tests.ui.scripted_model import ANSWER_WORDS, ScriptedChatModel, answer_bytes

pytestmark = pytest.mark.slow

API_KEY = "ui-test-key"


@pytest.fixture
def open_page(browser) -> Iterator:
    """``open_page(server)``: the chat page of that server, checked for console problems after."""
    pages: list[ChatPage] = []

    def open_(server, path: str = "/") -> ChatPage:
        page = ChatPage(browser, server.url)
        page.open(path)
        page.browser_problems()  # starts the log from this page
        pages.append(page)
        return page

    yield open_
    for page in pages:
        assert page.browser_problems() == []
        assert page.foreign_resources() == []


def test_answer_streams_in_token_by_token(live_server, open_page):
    server = live_server(model=ScriptedChatModel(step_ms=15))
    page = open_page(server)
    assert page.text("#model") == "scripted-chat"
    page.watch_answers()

    answer = page.ask("hello there")

    final = page.answer_text(answer)
    assert len(final.split()) == ANSWER_WORDS
    partials = [text for text in page.seen_answer_texts() if text and text != final]
    assert len(set(partials)) >= 5, partials  # it grew step by step, not all at once
    assert all(final.startswith(text) for text in partials)
    assert page.text("article.user .body") == "hello there"
    # stats of the answer: TTFT, decode speed, tokens (one a byte, and the EOS), finish reason
    assert float(page.stat(answer, "ttft")) > 0
    assert float(page.stat(answer, "rate")) > 0
    assert int(page.stat(answer, "tokens")) == len(final.encode()) + 1
    assert page.stat(answer, "finish") == "stop"
    assert page.stat(answer, "id") == answer.get_attribute("data-request-id")


def test_stop_cancels_on_the_server_and_frees_the_slot(live_server, open_page):
    server = live_server(model=ScriptedChatModel(step_ms=20))
    page = open_page(server)
    page.set_setting("max_completion_tokens", "4000")  # 80 s of steps: only Stop ends it
    before = len(page.answers())
    page.type_and_press_enter("tell a long story")
    page.wait(lambda d: len(page.answers()) > before, "the answer started")
    answer = page.answers()[-1]
    page.wait(lambda d: len(page.answer_text(answer)) >= 40, "40 characters streamed")
    assert server.metric("slotserve_requests_running") == 1
    page.wait(lambda d: page.live("running") == "1", "the live panel shows it running")
    page.wait(lambda d: float(page.live("tps").replace("–", "0")) > 0, "panel tokens/s")
    assert float(page.live("batch")) >= 1

    page.click("#stop")

    page.wait(lambda d: answer.get_attribute("data-state") == "stopped", "the answer stopped")
    wait_until(lambda: server.metric("slotserve_requests_running") == 0, what="slot freed")
    cancelled = server.metric("slotserve_requests_finished_total", finish_reason="cancelled")
    assert cancelled == 1
    # the server ended the stream itself (DELETE), so its final chunk reached the page
    assert page.stat(answer, "finish") == "cancelled"
    stopped_text = page.answer_text(answer)
    assert server.metric("slotserve_generated_tokens_total") < 4000
    page.wait(lambda d: page.live("running") == "0", "the live panel shows the slot free")
    assert page.answer_text(answer) == stopped_text  # nothing more arrived
    assert page.find("#send").is_enabled() and not page.find("#stop").is_enabled()


def test_same_seed_same_answer(live_server, open_page):
    server = live_server(model=ScriptedChatModel(step_ms=2))
    page = open_page(server)
    page.set_setting("seed", "1234")
    first = page.answer_text(page.ask("tell me something"))
    again = page.answer_text(page.regenerate())
    assert again == first

    page.set_setting("seed", "99")
    other = page.answer_text(page.regenerate())
    assert other != first

    page.click("#clear")
    assert page.answers() == []
    assert page.answer_text(page.ask("tell me something")) == other  # the same conversation

    page.set_setting("seed", "")  # the server draws a seed per request
    unseeded = {page.answer_text(page.regenerate()) for _ in range(2)}
    assert len(unseeded) == 2


def test_markup_in_an_answer_is_shown_as_text(live_server, open_page, artifacts_dir):
    server = live_server(model=ScriptedChatModel(step_ms=1))
    page = open_page(server)
    script = "<script>window.__injected = 1</script>"
    image = '<img src=x onerror="window.__injected = 2">'
    said = (
        f"{script}{image}\n"
        "## Markdown, **safely**\n"
        "- `x < y` is *code*\n"
        "- a [link](https://example.org/) and a [bad one](javascript:alert(1))\n"
        "```html\n<b>not bold</b>\n```\n"
        "> quoted <i>x</i>\n\n"
        "| step | rows |\n| --- | ---: |\n| 1 | <u>4</u> |\n\n"
        "3. third\n   - nested\n4. fourth"
    )
    page.paste_and_click_send("say " + said)
    answer = page.wait_answer(0)

    assert page.js("return window.__injected") is None
    body = answer.find_element("css selector", ".body")
    assert script + image in body.text
    tags = page.js("return [...document.querySelectorAll('#conversation *')].map(e => e.localName)")
    assert not {"script", "img", "b", "i", "u"} & set(tags)
    assert page.text("article.assistant h2") == "Markdown, safely"
    assert page.text("article.assistant h2 strong") == "safely"
    assert page.text("article.assistant li code") == "x < y"
    assert page.text("article.assistant pre code") == "<b>not bold</b>"
    assert page.js("return document.querySelector('article.assistant pre').dataset.lang") == "html"
    assert page.text("article.assistant blockquote") == "quoted <i>x</i>"
    cells = page.js(
        "return [...document.querySelectorAll('article.assistant td')]"
        ".map(td => [td.textContent, td.style.textAlign])"
    )
    assert cells == [["1", ""], ["<u>4</u>", "right"]]
    assert page.js("return document.querySelector('article.assistant ol').start") == 3
    assert page.text("article.assistant ol > li:first-child > ul > li") == "nested"
    assert page.text("article.assistant ol > li:last-child") == "fourth"
    links = page.js(
        "return [...document.querySelectorAll('article.assistant a')]"
        ".map(a => [a.textContent, a.href, a.rel])"
    )
    assert links == [["link", "https://example.org/", "noopener noreferrer nofollow"]]
    assert "[bad one](javascript:alert(1))" in body.text
    # the user's own message is text too
    assert page.text("article.user .body").startswith("say " + script)
    record_artifact(page.screenshot(artifacts_dir / "chat.png"))


def test_api_key_entered_once_and_kept_for_the_tab(live_server, open_page):
    server = live_server(api_key=API_KEY, model=ScriptedChatModel(step_ms=2))
    page = open_page(server)  # the page itself needs no key
    page.wait(lambda d: page.find("#key-needed").is_displayed(), "the page asks for the key")
    page.wait(lambda d: page.text("#live-state") == "API key needed", "panel: key needed")

    page.find("#api-key").send_keys(API_KEY, "\n")

    page.wait(lambda d: page.text("#model") == "scripted-chat", "models listed with the key")
    assert not page.find("#key-needed").is_displayed()
    page.wait(lambda d: page.live("running") == "0", "the panel reads /metrics with the key")
    assert page.stat(page.ask("hello"), "finish") == "stop"
    assert page.js("return sessionStorage.getItem('slotserve.apiKey')") == API_KEY
    assert API_KEY not in (page.js("return localStorage.getItem('slotserve.settings')") or "")

    page.open()  # a reload: the key is still there, nobody is asked again
    assert page.text("#model") == "scripted-chat"
    assert not page.find("#key-needed").is_displayed()
    assert page.stat(page.ask("hello again"), "finish") == "stop"


def test_ui_path_serves_the_same_page(live_server, open_page):
    server = live_server(model=ScriptedChatModel(step_ms=1))
    page = open_page(server, "/ui")
    assert page.stat(page.ask("hi"), "finish") == "stop"


def test_bad_settings_are_refused_with_their_reason_and_nothing_is_lost(live_server, open_page):
    server = live_server(model=ScriptedChatModel(step_ms=1))
    page = open_page(server)
    page.set_setting("response_format", "{")
    page.type_and_press_enter("hi")
    page.wait(lambda d: "not valid JSON" in page.text("#notice"), "the page names the field")
    assert page.answers() == []
    assert page.find("#prompt").get_attribute("value") == "hi"  # still there to send

    page.set_setting("response_format", '{"type": "nonsense"}')  # valid JSON, refused by the server
    page.click("#send")
    answer = page.wait_answer(0, state="error")
    refusal = page.text("article.assistant p.error")
    assert "response_format" in refusal and "(400)" in refusal
    assert server.metric("slotserve_requests_running") == 0

    page.set_setting("response_format", '{"type": "text"}')
    answer = page.regenerate()  # the failed answer is asked again; the question was kept
    assert page.stat(answer, "finish") == "stop"
    assert len(page.driver.find_elements("css selector", "article.user")) == 1


def test_settings_reach_the_server_as_typed(live_server, open_page):
    model = ScriptedChatModel(step_ms=1)
    page = open_page(live_server(model=model))
    page.set_setting("temperature", "3")  # API.md: 0..2
    page.type_and_press_enter("hi")
    page.wait(lambda d: page.text("#notice").startswith("Temperature: "), "refused in the page")
    assert page.answers() == [] and model.started_sampling == []

    for name, value in {"temperature": "0.33", "top_p": "0.9", "top_k": "5", "seed": "42"}.items():
        page.set_setting(name, value)  # 0.33 is off the spinner's 0.05 steps, and fine
    penalties = {"presence_penalty": "0.5", "frequency_penalty": "-0.3", "min_p": "0.05"}
    penalties |= {"repetition_penalty": "1.2", "min_tokens": "2"}
    for name, value in penalties.items():
        page.set_setting(name, value)
    page.set_setting("stop", "slot")
    page.click("#send")
    answer = page.wait_answer(0)
    (sampling,) = model.started_sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.33, 0.9, 5)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.3)
    assert (sampling.min_p, sampling.repetition_penalty, sampling.min_tokens) == (0.05, 1.2, 2)
    assert sampling.seed == 42
    said = bytes(answer_bytes("hi", 42)).decode()
    assert page.answer_text(answer) == said.partition("slot")[0].strip()  # cut by the stop
    assert page.text("#notice") == ""

    page.driver.refresh()  # settings are kept by the browser
    page.wait(lambda d: page.text("#model") == "scripted-chat", "reloaded")
    assert page.find("#setting-temperature").get_attribute("value") == "0.33"
    page.click("#defaults")
    assert page.find("#setting-temperature").get_attribute("value") == "0.7"


def test_reasoning_is_folded_above_the_answer(live_server, open_page):
    server = live_server(model=ScriptedChatModel(step_ms=1), reasoning_parser="think")
    page = open_page(server)
    answer = page.ask("say <think>Pondering the slots.</think>The answer.")

    assert page.answer_text(answer) == "The answer."
    folded = page.js(
        "const d = arguments[0].querySelector('details.reasoning');"
        "return [d.hidden, d.open, d.querySelector('summary').textContent,"
        " d.querySelector('.thought').textContent]",
        answer,
    )
    assert folded == [False, False, "Reasoning", "Pondering the slots."]
    plain = page.ask("say no reasoning here")
    assert page.js("return arguments[0].querySelector('details.reasoning').hidden", plain)
