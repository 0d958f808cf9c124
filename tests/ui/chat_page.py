"""The chat page as a test sees it: what a user does (type, press Enter, click) and what they see
(DOM state), every wait a wait on a DOM condition."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.expected_conditions import staleness_of
from selenium.webdriver.support.wait import WebDriverWait

from tests.ui.conftest import DOM_POLL_S, DOM_TIMEOUT_S

T = TypeVar("T")

# Records every distinct text of the newest answer as the DOM changes (a MutationObserver
# callback per change, so no partial state is missed between two polls of the test).
_WATCH_ANSWERS = """
window.__answerTexts = [];
const conversation = document.getElementById("conversation");
new MutationObserver(() => {
  const answers = conversation.querySelectorAll("article.assistant .body");
  if (!answers.length) return;
  const text = answers[answers.length - 1].textContent;
  const seen = window.__answerTexts;
  if (seen[seen.length - 1] !== text) seen.push(text);
}).observe(conversation, {childList: true, subtree: true, characterData: true});
"""


class ChatPage:
    def __init__(self, driver: WebDriver, url: str) -> None:
        self.driver = driver
        self.url = url

    # ------------------------------------------------------------------ waiting and reading
    def wait(self, condition: Callable[[WebDriver], T], what: str) -> T:
        waiter = WebDriverWait(self.driver, DOM_TIMEOUT_S, poll_frequency=DOM_POLL_S)
        return waiter.until(condition, message=what)

    def js(self, script: str, *args: object) -> object:
        return self.driver.execute_script(script, *args)

    def find(self, css: str) -> WebElement:
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def text(self, css: str) -> str:
        return self.js("return document.querySelector(arguments[0]).textContent", css)

    def open(self, path: str = "/") -> None:
        self.driver.get(self.url + path)
        self.wait(lambda d: self.text("#model") != "connecting…", "the model name loaded")

    def answers(self) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, "article.assistant")

    def answer_text(self, answer: WebElement) -> str:
        return self.js("return arguments[0].querySelector('.body').textContent", answer)

    def stat(self, answer: WebElement, name: str) -> str | None:
        return self.js(
            "const s = arguments[0].querySelector(`[data-stat='${arguments[1]}']`);"
            "return s ? s.dataset.value : null",
            answer,
            name,
        )

    def live(self, name: str) -> str:
        return self.text(f"#live-{name}")

    # ------------------------------------------------------------------ doing
    def type_and_press_enter(self, text: str) -> None:
        self.find("#prompt").send_keys(text, Keys.ENTER)

    def paste_and_click_send(self, text: str) -> None:
        """Puts ``text`` (newlines included, which typed would be Enter) in the box, clicks Send."""
        self.js("document.getElementById('prompt').value = arguments[0]", text)
        self.find("#send").click()

    def set_setting(self, name: str, value: str | bool) -> None:
        field = self.find(f"#setting-{name}")
        if isinstance(value, bool):
            if field.is_selected() != value:
                field.click()
            return
        field.clear()
        field.send_keys(value)
        field.send_keys(Keys.TAB)  # a "change" event, as leaving the field does

    def click(self, css: str) -> None:
        self.find(css).click()

    def watch_answers(self) -> None:
        self.js(_WATCH_ANSWERS)

    def seen_answer_texts(self) -> list[str]:
        return list(self.js("return window.__answerTexts"))

    def ask(self, text: str) -> WebElement:
        """Sends ``text`` with Enter and waits for the whole answer; returns its article."""
        before = len(self.answers())
        self.type_and_press_enter(text)
        return self.wait_answer(before)

    def regenerate(self) -> WebElement:
        """Clicks the last answer's Regenerate and waits for the new answer."""
        old = self.answers()[-1]
        old.find_element(By.CSS_SELECTOR, "button.regenerate").click()
        self.wait(staleness_of(old), "the old answer is gone")
        return self.wait_answer(len(self.answers()) - 1)

    def wait_answer(self, answers_before: int, state: str = "done") -> WebElement:
        def finished(driver: WebDriver) -> WebElement | None:
            answers = self.answers()
            if len(answers) <= answers_before:
                return None
            return answers[-1] if answers[-1].get_attribute("data-state") == state else None

        return self.wait(finished, f"an answer in state {state!r}")

    def screenshot(self, path: Path) -> Path:
        assert self.driver.save_screenshot(str(path)), f"no screenshot written to {path}"
        return path

    # ------------------------------------------------------------------ what went wrong
    def browser_problems(self) -> list[str]:
        """Console entries that mean the page broke: a refused inline script or style (the
        Content-Security-Policy), an uncaught exception. Reading them empties the log."""
        entries = self.driver.get_log("browser")
        return [
            entry["message"]
            for entry in entries
            if "Content Security Policy" in entry["message"] or "Uncaught" in entry["message"]
        ]

    def foreign_resources(self) -> list[str]:
        """Every URL the page fetched that is not of its own origin."""
        return list(
            self.js(
                "return performance.getEntriesByType('resource').map(e => e.name)"
                ".filter(name => !name.startsWith(location.origin + '/'))"
            )
        )
