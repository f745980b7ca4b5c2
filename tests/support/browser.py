"""Headless Chromium for the dashboard's tests: Debian's ``chromium`` driven through its ``chromedriver``.

Both come from the distribution (``make chromium``); paths are given to selenium, so its Selenium
Manager never runs and nothing is downloaded while the tests run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WINDOW = (1400, 1100)
"""The window the README's screenshot is taken in."""

T = TypeVar("T")


@contextmanager
def chromium() -> Iterator[WebDriver]:
    """A headless Chromium, quit on exit."""
    missing = [str(path) for path in (CHROMIUM, CHROMEDRIVER) if not path.exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: run `make chromium` (Debian's chromium and chromium-driver)")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(
    driver: WebDriver, check: Callable[[WebDriver], T], what: str, *, timeout_s: float = 15.0, poll_s: float = 0.1
) -> T:
    """Polls ``check(driver)`` until it returns something truthy, and returns that; fails naming ``what``."""
    waited: T = WebDriverWait(driver, timeout_s, poll_frequency=poll_s).until(
        check, f"timed out after {timeout_s:g} s waiting for {what}"
    )
    return waited


def script(driver: WebDriver, source: str, *args: Any) -> Any:
    """Runs ``source`` in the page (one task of its event loop: what it reads is one consistent state)."""
    return driver.execute_script(source, *args)
