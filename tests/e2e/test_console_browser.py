"""The web console end to end: headless Chromium finds a pending saga, aborts it, sees it end.

Real processes on the real services: a coordinator, the participants ``ledger``
(accounts) and ``shop`` (orders) on PostgreSQL, and ``saga console``. ``shop`` runs
once (so it is a known participant) and is stopped; a saga with a ``ledger`` step
and a ``shop`` step then stays ``pending`` (ledger applied, shop waiting) for as long
as its deadline, an hour. The browser (Debian's ``chromium`` and ``chromium-driver``,
installed by infra/chromium.sh; no download) types its tx_id into the search box,
opens its row, clicks Abort, confirms with a reason, and sees ``rolling_back``;
``shop`` comes back to compensate its step (it never applied it), and the page shows
``rolled_back``. The audit trail shows the abort with the operator's name.

Screenshots of the main views go to the test's tmp folder, and to the folder named
by ``SAGA_CONSOLE_SCREENSHOTS`` when set (``make console-screenshots`` writes
docs/img/console-*.png).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from saga.streams import SagaState
from tests._console import bank_system, debit, shop, start_console, stuck_saga
from tests._infra import ROOT, Services
from tests._system import SagaSystem

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

OPERATOR = "e2e-operator"
HOSTILE_NAME = "<img src=x onerror=window.pwned=1>"
BROWSER = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"


@pytest.fixture
def system(services: Services, pg_schema: tuple[str, str], tmp_path: Path) -> Iterator[SagaSystem]:
    with bank_system(services, pg_schema[1], tmp_path) as made:
        yield made


@pytest.fixture(scope="module")
def chromium() -> None:
    """Debian's chromium and chromium-driver, installed by infra/chromium.sh if missing."""
    done = subprocess.run(
        [str(ROOT / "infra" / "chromium.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"infra/chromium.sh could not provide a browser: {done.stderr}", pytrace=False)


@pytest.fixture
def browser(chromium: None, tmp_path: Path) -> Iterator[WebDriver]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for flag in (
        "--headless=new",
        "--no-sandbox",  # the tests run as root
        "--disable-dev-shm-usage",
        "--window-size=1400,900",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        # What the page showed last, next to the processes' logs, for a failed run.
        try:
            driver.save_screenshot(str(tmp_path / "browser-last.png"))
            (tmp_path / "browser-last.html").write_text(driver.page_source)
        finally:
            driver.quit()


def shot(driver: WebDriver, name: str, tmp: Path, height: int = 900) -> None:
    """Save the page as console-<name>.png (toast hidden, ``height`` pixels tall)."""
    driver.execute_script("document.getElementById('toast').hidden = true")
    driver.set_window_size(1400, height)
    folders = [tmp]
    if os.environ.get("SAGA_CONSOLE_SCREENSHOTS"):
        folders.append(ROOT / os.environ["SAGA_CONSOLE_SCREENSHOTS"])
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(folder / f"console-{name}.png"))


def test_a_pending_saga_is_found_aborted_and_seen_rolled_back_in_the_browser(
    system: SagaSystem, browser: WebDriver, tmp_path: Path
) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    # The page refreshes every 1.5 s: an element read between two refreshes may be gone.
    wait = WebDriverWait(
        driver,
        60,
        poll_frequency=0.2,
        ignored_exceptions=[StaleElementReferenceException],
    )

    stuck = stuck_saga(system)
    with system.producer() as producer:  # a dead letter for the DLQ view
        producer.produce(system.settings.topics.requests, "poison-1", b"{not json")
        producer.flush(30)

    console, url = start_console(system, "--operator", OPERATOR)
    driver.get(url)
    search = wait.until(ec.element_to_be_clickable((By.ID, "search")))
    search.send_keys(stuck)
    row = (By.CSS_SELECTOR, f'#sagas tr[data-tx="{stuck}"]')
    wait.until(ec.visibility_of_element_located(row))
    # The search leaves only the saga asked for.
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#sagas tr")) == 1)
    search.clear()
    search.send_keys(stuck[:6])
    wait.until(ec.visibility_of_element_located(row))
    driver.find_element(*row).click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "detail-state"), "pending"))
    wait.until(ec.element_to_be_clickable((By.ID, "abort")))
    search.clear()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#sagas tr")) >= 3)
    shot(driver, "sagas", tmp_path)

    driver.find_element(By.ID, "abort").click()
    wait.until(ec.visibility_of_element_located((By.ID, "abort-dialog")))
    driver.find_element(By.ID, "abort-reason").send_keys("shop is down")
    driver.find_element(By.ID, "abort-confirm").click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "detail-state"), "rolling_back"))
    reason = f"aborted by operator {OPERATOR} (saga console): shop is down"
    assert driver.find_element(By.ID, "detail-reason").text == reason

    shop(system)  # owes the compensation of a step it never applied
    wait.until(ec.text_to_be_present_in_element((By.ID, "detail-state"), "rolled_back"))
    steps = driver.find_element(By.ID, "detail-steps").text
    assert steps.count("compensated") == 2, steps
    # The timeline (saga history) shows the request, the abort and the decision.
    for kind in ("saga.request", "saga.abort", "saga.decision"):
        wait.until(ec.text_to_be_present_in_element((By.ID, "timeline"), kind))
    shot(driver, "saga", tmp_path, height=1400)

    driver.set_window_size(1400, 900)
    driver.find_element(By.ID, "tab-audit").click()
    audit = (By.CSS_SELECTOR, "#audit tr")
    wait.until(ec.visibility_of_element_located(audit))
    line = driver.find_element(*audit).text
    # The outcome says "honoured", or "timeout" when the machine is too slow to decide
    # within the console's wait; the decision checked below is what matters.
    assert OPERATOR in line and "abort" in line and stuck in line, line
    shot(driver, "audit", tmp_path)

    driver.find_element(By.ID, "tab-dlq").click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "dlq"), "poison-1"))
    shot(driver, "dlq", tmp_path)

    # The participants tab shows only where the participant registry is installed.
    tab = driver.find_element(By.ID, "tab-participants")
    if tab.is_displayed():
        tab.click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "participants"), "ledger"))
        shot(driver, "participants", tmp_path)

    with system.client() as client:  # markup in a saga's name is shown, never run
        hostile = client.submit([debit(1)], saga=HOSTILE_NAME, timeout=120)
        assert client.result(hostile, timeout=120).state is SagaState.COMMITTED
    driver.find_element(By.ID, "tab-sagas").click()
    hostile_row = (By.CSS_SELECTOR, f'#sagas tr[data-tx="{hostile}"]')
    wait.until(ec.text_to_be_present_in_element(hostile_row, HOSTILE_NAME))
    assert driver.execute_script("return window.pwned") is None
    assert not driver.find_elements(By.CSS_SELECTOR, "#sagas img")

    assert console.alive, console.log()
    # The abort reached the coordinator as a decision that names the operator.
    [decision] = system.decisions(stuck)
    assert decision.reason == reason
