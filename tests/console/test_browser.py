"""The console in a real browser: headless Chromium from Debian's packages, driven by Selenium through
Debian's chromedriver (nothing is downloaded at run time). Screenshots of every page go to
``.artifacts/console/`` (or ``$CELLSTREAM_ARTIFACTS/console/``)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr
from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.wait import WebDriverWait

from tests.console.support import TriageApp, serving, triage_app

pytestmark = pytest.mark.browser
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("CELLSTREAM_ARTIFACTS", ".artifacts")) / "console"
TOKEN = "console-test-token-5f1c-0123"


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    for program in (CHROMIUM, CHROMEDRIVER):
        # Never a skip: `make test` installs both (scripts/install.sh); a browser test that cannot run fails.
        assert shutil.which(program), f"{program} is missing: run scripts/install.sh (Debian chromium, chromium-driver)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-extensions", "--no-first-run",
                 "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver: WebDriver, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Until ``check()`` is true. A page that reloads itself (a job's) may be replaced while the check reads
    it: an element gone stale or not rendered yet counts as not yet (a CI run failed on a stale one)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (StaleElementReferenceException, NoSuchElementException):
            pass
        except WebDriverException as exc:
            if "does not belong to the document" not in (exc.msg or ""):
                raise
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def replaced(driver: WebDriver, page: WebElement) -> None:
    """Wait until ``page`` (a page's html element) has been replaced by another page.

    Not selenium's ``staleness_of`` alone: while the old page is torn down, chromedriver may answer
    "Node with given id does not belong to the document" as an unknown error instead of a stale
    element, which failed a CI run.
    """
    def gone(_driver: WebDriver) -> bool:
        try:
            page.is_enabled()
        except StaleElementReferenceException:
            return True
        except WebDriverException as exc:
            if "does not belong to the document" not in (exc.msg or ""):
                raise
            return True
        return False

    WebDriverWait(driver, 30).until(gone)


def click(driver: WebDriver, element_id: str) -> None:
    """Click a button or link that loads another page, and wait until that page has replaced this one."""
    page = driver.find_element(By.TAG_NAME, "html")
    driver.find_element(By.ID, element_id).click()
    replaced(driver, page)


def text(driver: WebDriver, css: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, css).text)


@pytest.fixture
def billing(tmp_path: Path) -> TriageApp:
    return triage_app(tmp_path)


def test_log_in_filter_open_fix_bulk_replay_and_bulk_discard(browser: WebDriver, billing: TriageApp) -> None:
    with serving({"billing": billing.queue}, token=SecretStr(TOKEN)) as console:
        # Without a session every page sends to the login; a wrong token is refused there.
        browser.get(console.url + "/entries?handler=bill_rider")
        assert "/login" in browser.current_url
        browser.find_element(By.ID, "name").send_keys("alice")
        browser.find_element(By.ID, "token").send_keys("not-the-token")
        click(browser, "login")
        assert text(browser, ".error") == "wrong token"
        shot(browser, "login-refused")
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        click(browser, "login")
        # Back where the login interrupted: the list, filtered to the fixable handler.
        assert browser.current_url.endswith("/entries?handler=bill_rider")
        assert text(browser, "#total").startswith("Entries 1 to 4 of 4")

        browser.get(console.url + "/")
        counts = text(browser, ".counts")
        assert "7\nopen" in counts and "7\nin all" in counts
        assert "CardDeclined" in text(browser, "table.groups")
        shot(browser, "overview")

        # Filter in the form: the error type and text in the message.
        browser.get(console.url + "/entries")
        browser.find_element(By.NAME, "error").send_keys("CardDeclined")
        browser.find_element(By.NAME, "text").send_keys("rider-3 ")
        click(browser, "apply")
        assert text(browser, "#total").startswith("Entries 1 to 1 of 1")
        shot(browser, "entries-filtered")
        page = browser.find_element(By.TAG_NAME, "html")
        browser.find_element(By.CSS_SELECTOR, "a.entry").click()
        replaced(browser, page)
        assert text(browser, "#status") == "open"
        assert '"rider": "rider-3"' in text(browser, "#body")
        assert "CardDeclined: card of rider-3 declined" in text(browser, "#traceback .raised")
        assert "the app" in text(browser, "#history")
        shot(browser, "entry")

        # The fix is deployed; replay every entry of the handler, from the list, through the dry run.
        billing.fix()
        browser.get(console.url + "/entries?handler=bill_rider")
        shot(browser, "entries")
        click(browser, "bulk-replay")
        assert "4 open or interrupted entries of 4 matching would be replayed" in text(browser, "#preview")
        shot(browser, "replay-preview")
        browser.find_element(By.ID, "confirm").click()
        click(browser, "go")
        until(lambda: text(browser, "#state") == "done", "the replay job to finish")  # the page reloads itself
        assert text(browser, "#done") == "4 of 4"
        assert text(browser, "#results").count("resolved") == 4
        shot(browser, "replay-job")

        browser.get(console.url + "/entries?handler=bill_rider&status=resolved")
        assert text(browser, "#total").startswith("Entries 1 to 4 of 4")
        page = browser.find_element(By.TAG_NAME, "html")
        browser.find_element(By.CSS_SELECTOR, "a.entry").click()
        replaced(browser, page)
        history = text(browser, "#history")
        assert "replay succeeded" in history and "console:alice" in history

        # The other handler cannot be fixed: discard its entries, with a reason.
        browser.get(console.url + "/entries?handler=notify")
        click(browser, "bulk-discard")
        assert "3 open or interrupted entries of 3 matching would be discarded" in text(browser, "#preview")
        browser.find_element(By.ID, "reason").send_keys("riders without an address: notified by mail")
        browser.find_element(By.ID, "confirm").click()
        shot(browser, "discard-preview")
        click(browser, "go")
        until(lambda: text(browser, "#state") == "done", "the discard job to finish")
        assert text(browser, "#results").count("discarded") == 3
        shot(browser, "discard-job")
        browser.get(console.url + "/")
        assert "0\nopen" in text(browser, ".counts")

    # What the browser did is in the store, with who and why.
    entries = billing.queue.list()
    assert sorted(e.status for e in entries) == ["discarded"] * 3 + ["resolved"] * 4
    for entry in entries:
        last = entry.history[-1]
        assert last.actor == "console:alice"
        if entry.status == "discarded":
            assert last.note == "riders without an address: notified by mail"
