"""Debian's Chromium, headless, driven by Selenium through Debian's chromedriver (tests/ui and
scripts/ui_screenshot.py).

    with headless_chromium() as driver:
        driver.get("http://127.0.0.1:8000/")

Selenium is given both binaries, so it never runs Selenium Manager (which would look for, and try
to download, a browser and a driver of its own: impossible offline). Install them with
``apt-get install chromium chromium-driver`` (``.ci/run`` does).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser")
CHROMEDRIVER_NAMES = ("chromedriver",)
DEBIAN_DIR = "/usr/lib/chromium"
# Without the background-networking switches Chromium's own connections (updates, sync,
# components) fail on machines that reach no such service, and stall it; the rest keep a fresh
# profile quiet and fit a container (/dev/shm is small there, no sandbox, no GPU).
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--no-default-browser-check",
    "--password-store=basic",
)


class ChromiumMissing(RuntimeError):
    """Selenium, chromium or chromedriver is not installed; the message says which."""


@dataclass(frozen=True, slots=True)
class ChromiumBinaries:
    browser: str
    driver: str


def _which(names: tuple[str, ...]) -> str | None:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
        if Path(DEBIAN_DIR, name).is_file():
            return str(Path(DEBIAN_DIR, name))
    return None


def find_chromium() -> ChromiumBinaries:
    """Raises ChromiumMissing naming what is not installed."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        raise ChromiumMissing("selenium is not installed (pyproject.toml's 'test' extra)") from None
    browser, driver = _which(CHROMIUM_NAMES), _which(CHROMEDRIVER_NAMES)
    missing = [
        name for name, path in (("chromium", browser), ("chromium-driver", driver)) if not path
    ]
    if browser is None or driver is None:
        raise ChromiumMissing(
            f"{' and '.join(missing)} not installed (apt-get install {' '.join(missing)})"
        )
    return ChromiumBinaries(browser=browser, driver=driver)


@contextmanager
def headless_chromium(*, window: tuple[int, int] = (1280, 860)) -> Iterator:
    """A Selenium ``webdriver.Chrome`` on a fresh profile, quit (and the profile removed) on exit.

    Args:
        window: the viewport's size in CSS pixels (screenshots have this size).

    Raises:
        ChromiumMissing: see ``find_chromium``.
    """
    binaries = find_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binaries.browser
    with tempfile.TemporaryDirectory(prefix="slotserve-chromium-") as profile:
        flags = [
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={window[0]},{window[1]}",
        ]
        for flag in flags:
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        driver = webdriver.Chrome(options=options, service=Service(executable_path=binaries.driver))
        try:
            yield driver
        finally:
            driver.quit()
