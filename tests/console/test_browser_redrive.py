"""The redrive-policy pages in headless Chromium (the pattern of test_browser.py): from the navigation to an app's
policy, a change typed in the form and put in force, shown with who made it; screenshots in .artifacts/console/."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

import logstore
from indexer import App
from indexer.runtime.redrive import PolicyStore
from tests.console.support import serving
from tests.console.test_browser import TOKEN, browser, click, replaced, shot, text

pytestmark = pytest.mark.browser
__all__ = ["browser"]  # the fixture, used by name


def test_an_operator_reads_and_changes_an_apps_redrive_policy(browser: WebDriver, tmp_path: Path) -> None:
    with logstore.open(f"sqlite:///{tmp_path / 'store'}", shards=8) as store:
        app = App("billing", store=store, redrive={"delay": 300, "max_redrives": 3, "errors": ["Timeout"]})
        app.trigger("BASE")(lambda cell: None)
        app.drain(timeout=30)  # seeds the declaration
        with serving({"billing": app.dlq}, token=SecretStr(TOKEN)) as console:
            browser.get(console.url + "/redrive")
            browser.find_element(By.ID, "name").send_keys("carol")
            browser.find_element(By.ID, "token").send_keys(TOKEN)
            click(browser, "login")
            assert "the app's declaration" in text(browser, "#policies")
            shot(browser, "redrive-list")
            page = browser.find_element(By.TAG_NAME, "html")
            browser.find_element(By.LINK_TEXT, "billing").click()
            replaced(browser, page)
            assert text(browser, "#errors") == "Timeout"
            assert text(browser, "#max-redrives") == "3 redrives at most per entry"
            errors = browser.find_element(By.ID, "f-errors")
            errors.clear()
            errors.send_keys("Timeout, CardDeclined")
            redrives = browser.find_element(By.ID, "f-max_redrives")
            redrives.clear()
            redrives.send_keys("5")
            browser.find_element(By.ID, "f-note").send_keys("the gateway is flaky this week")
            click(browser, "save")
            assert text(browser, "#errors") == "Timeout, CardDeclined"
            assert text(browser, "#max-redrives") == "5 redrives at most per entry"
            assert text(browser, "#origin").startswith("changed by console:carol")
            assert "the gateway is flaky this week" in text(browser, "#history")
            shot(browser, "redrive-policy")
        record = PolicyStore(app.dlq.deadletters).get()
        assert record is not None and record.actor == "console:carol" and record.policy is not None
        assert record.policy.max_redrives == 5 and record.policy.errors == ("Timeout", "CardDeclined")
        app.close()
