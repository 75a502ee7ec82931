"""Debian's chromium, driven by Playwright, for tests that do what a person does in a UI.

Playwright cannot download its own browsers here: `.ci/run` installs Debian's chromium. Outside CI
a machine without it skips these tests; in CI (``CI`` set) that is a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
OUTPUT = Path(os.environ.get("PREFECT_JAX_TEST_OUTPUT", ROOT / "test-output")) / "browser"


def require_chromium() -> str:
    if CHROMIUM is None:
        if os.environ.get("CI") or os.environ.get("PREFECT_JAX_REQUIRE_BROWSER"):
            pytest.fail(
                "chromium is not installed: "
                ".ci/run installs Debian's chromium for the browser tests"
            )
        pytest.skip("no chromium here (apt-get install chromium)")
    return CHROMIUM


@contextlib.contextmanager
def browser_page() -> Iterator:
    """A page of a headless chromium, 1400x1000; screenshots go to `OUTPUT`."""
    from playwright.sync_api import sync_playwright

    executable = require_chromium()
    OUTPUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=executable, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            # (a UI's first load on two busy cores can take longer than Playwright's 30 s)
            page.set_default_timeout(120_000)
            page.set_default_navigation_timeout(120_000)
            yield page
        finally:
            browser.close()


def retry_in_the_ui(ui_url: str, flow_run_id: str, shots: str = "retry") -> None:
    """Open a flow run's page, see it Crashed, press Retry and confirm, as a person does."""
    with browser_page() as page:
        page.goto(f"{ui_url}/runs/flow-run/{flow_run_id}", wait_until="networkidle")
        page.get_by_text("Crashed").first.wait_for(timeout=60_000)
        page.screenshot(path=str(OUTPUT / f"{shots}-crashed.png"), full_page=True)
        page.get_by_role("button", name="Retry").first.click()
        dialog = page.get_by_role("dialog")
        dialog.get_by_role("button", name="Retry").click()
        dialog.wait_for(state="detached", timeout=30_000)
        page.screenshot(path=str(OUTPUT / f"{shots}-retried.png"), full_page=True)


def screenshot_flow_run(
    ui_url: str, flow_run_id: str, name: str, wait_for_text: str, task_run: str
) -> str:
    """A full-page screenshot of a flow run's Task Runs tab once `wait_for_text` shows on the
    page and task run `task_run` in the tab; returns the page's text."""
    with browser_page() as page:
        page.goto(f"{ui_url}/runs/flow-run/{flow_run_id}", wait_until="networkidle")
        page.get_by_text(wait_for_text).first.wait_for(timeout=60_000)
        page.get_by_text("Task Runs", exact=True).first.click()
        # (a tab of the app, not a page: its list comes by its own request, after the click)
        page.get_by_text(task_run).first.wait_for(timeout=60_000)
        page.screenshot(path=str(OUTPUT / f"{name}.png"), full_page=True)
        return page.inner_text("body")
