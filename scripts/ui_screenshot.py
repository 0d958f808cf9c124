"""Takes the screenshot of the chat page that README shows (docs/ui.png).

    python scripts/ui_screenshot.py                      # SmolLM2, the default model
    python scripts/ui_screenshot.py --out /tmp/ui.png -- --model mock --mock-step-ms 20

Starts ``python -m app serve`` (the flags after ``--``) on a free port, opens the page in
headless Chromium (scripts/headless_chromium.py), asks one question and waits for the answer,
asks a second and takes the picture while it streams, once the live panel shows it running.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from headless_chromium import headless_chromium
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.wait import WebDriverWait
from server_process import ROOT, ServerSpec, running

QUESTIONS = (
    "What is continuous batching, in two sentences?",
    "Write a Python function that reverses a string.",
)
SYSTEM_PROMPT = "You are a concise assistant."
WAIT_S = 120.0  # the real model on a busy 2-core CPU
STREAMED_CHARS = 160  # how much of the second answer is on the picture


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "ui.png")
    parser.add_argument("--seed", default="", help="seed of both answers (default: none)")
    parser.add_argument("server_flags", nargs="*", help="flags of python -m app serve (after --)")
    args = parser.parse_args(argv)
    spec = ServerSpec.app("ui", *args.server_flags, ready_timeout_s=WAIT_S)
    with tempfile.TemporaryDirectory() as logs, running(spec, Path(logs)) as server:
        with headless_chromium(window=(1280, 900)) as driver:
            wait = WebDriverWait(driver, WAIT_S, poll_frequency=0.05)
            text = lambda css: driver.execute_script(  # noqa: E731
                "const e = document.querySelector(arguments[0]); return e ? e.textContent : ''", css
            )
            driver.get(server.url + "/")
            wait.until(lambda d: text("#model") != "connecting…")
            settings = {"setting-seed": args.seed, "setting-max_completion_tokens": "200"}
            for field_id, value in settings.items():
                field = driver.find_element(By.ID, field_id)
                field.clear()
                field.send_keys(value, Keys.TAB)
            driver.find_element(By.ID, "system").send_keys(SYSTEM_PROMPT, Keys.TAB)
            prompt = driver.find_element(By.ID, "prompt")
            prompt.send_keys(QUESTIONS[0], Keys.ENTER)
            wait.until(lambda d: d.execute_script(
                "const a = document.querySelector('article.assistant');"
                "return a && a.dataset.state !== 'streaming'"
            ))  # fmt: skip
            prompt.send_keys(QUESTIONS[1], Keys.ENTER)
            wait.until(lambda d: len(text("article.assistant:last-of-type .body")) > STREAMED_CHARS)
            wait.until(lambda d: text("#live-running") == "1" and text("#live-tps") not in "–0")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
