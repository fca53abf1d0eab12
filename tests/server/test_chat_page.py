"""The built-in chat page at / driven in a real headless browser (Debian's chromium and chromedriver,
through selenium; installed by .ci/run): send, the reply streams in, stop, a second turn.

Runs in: the pytest process (the browser and the server in processes of their own).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.server.conftest import RunningServer, serving

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER), reason="chromium and chromedriver are not installed (.ci/run installs them)")


@pytest.fixture(scope="module")
def server(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    yield from serving(smollm2_path, tmp_path_factory, "page", "-c", "1024", "--parallel", "2", "-t", "2")


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM  # type: ignore[assignment]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1200,900"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield drv
    drv.quit()


def _wait(cond, timeout: float = 60.0, what: str = "") -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _replies(b: WebDriver) -> list:  # type: ignore[type-arg]
    return b.find_elements(By.CSS_SELECTOR, ".msg.assistant")


def test_page_is_self_contained(server: RunningServer) -> None:
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "http://" not in r.text and "https://" not in r.text  # no external assets
    assert "default-src 'self'" in r.headers["content-security-policy"]


def test_send_stream_stop_and_second_turn(server: RunningServer, browser: WebDriver) -> None:
    b = browser
    b.get(server.url + "/")
    _wait(lambda: b.find_element(By.ID, "model").text.startswith("SmolLM2"), what="the model name")
    # 1. send: the reply streams in (seen growing) and finishes
    b.find_element(By.ID, "temperature").clear()
    b.find_element(By.ID, "temperature").send_keys("0")
    b.find_element(By.ID, "input").send_keys("What is the capital of France? Answer in one word.")
    b.find_element(By.ID, "send").click()
    _wait(lambda: len(_replies(b)) == 1 and _replies(b)[0].get_attribute("data-finish"), what="the first reply")
    first = _replies(b)[0]
    assert "Paris" in first.text and first.get_attribute("data-finish") == "stop"
    assert b.find_element(By.ID, "send").is_enabled() and not b.find_element(By.ID, "stop").is_enabled()
    # 2. stop: a long reply is cut while it streams
    b.find_element(By.ID, "max_tokens").clear()
    b.find_element(By.ID, "max_tokens").send_keys("900")
    b.find_element(By.ID, "input").send_keys("Write a very long story about a dragon and a knight.")
    b.find_element(By.ID, "send").click()
    _wait(lambda: len(_replies(b)) == 2 and len(_replies(b)[1].text) > 40, what="the second reply to stream")
    seen = len(_replies(b)[1].text)
    b.find_element(By.ID, "stop").click()
    _wait(lambda: _replies(b)[1].get_attribute("data-finish") == "stopped", what="the stop")
    stopped = _replies(b)[1].text
    time.sleep(0.5)
    assert _replies(b)[1].text == stopped and len(stopped) >= seen  # nothing arrives after the stop
    _wait(lambda: httpx.get(server.url + "/metrics").text.count('powerinfer_requests_running 0.0') == 1, 10, "the slot to free")
    # 3. a second turn sees the history (the model's answer refers to it)
    b.find_element(By.ID, "max_tokens").clear()
    b.find_element(By.ID, "max_tokens").send_keys("24")
    b.find_element(By.ID, "input").send_keys("Repeat the name of the capital you gave first, one word.")
    b.find_element(By.ID, "send").click()
    _wait(lambda: len(_replies(b)) == 3 and _replies(b)[2].get_attribute("data-finish"), what="the third reply")
    assert _replies(b)[2].text.strip() and _replies(b)[2].get_attribute("data-finish") in ("stop", "length")
    assert "error" not in (_replies(b)[2].get_attribute("class") or "")
