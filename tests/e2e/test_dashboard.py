"""The gateway's ``/dashboard`` in a real browser: its figures move under load and agree with ``/metrics``,
its feed needs an operator key when API keys are on, a worker killed with ``kill -9`` shows as gone, and
one stopped with SIGTERM as stopped.

Headless Chromium (``tests.support.browser``) against real processes: ``batchwire up`` for the embedded
mode, and a gateway, a batcher and two workers over the session's Kafka and Redis. The load is
``batchwire bench`` in a process of its own (open loop, Poisson arrivals), so the test process only
drives the browser and scrapes ``/metrics``. Set ``BATCHWIRE_SCREENSHOT=docs/dashboard.png`` to write
the README's screenshot too; every run saves one under the test's tmp dir.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.webdriver import WebDriver
from selenium.webdriver.common.by import By

from tests.support.browser import WINDOW, chromium, script, wait_for
from tests.support.cluster_checks import proc_named
from tests.support.eventually import eventually_sync
from tests.support.processes import Cluster, Proc, embedded, launch

pytestmark = pytest.mark.slow

SIM_LATENCY_MS = 100.0
LOAD_RPS = 150
"""Modest for two shared cores: the service, the load generator and Chromium share them."""
READINGS = 6
"""Dashboard updates (one a second, each a one-second window) taken between two scrapes of /metrics."""
TOLERANCE = 0.35
SCREENSHOT_ENV = "BATCHWIRE_SCREENSHOT"
SCREENSHOT_HISTORY_S = 60.0
"""How long the load runs before the README's screenshot, so that its charts show a stretch of history."""
GONE_WITHIN_S = 5.0
"""3 missed one-second beats make a member gone; the page hears of it at its next one-second update."""
GREY = "rgb(164, 170, 184)"
"""The page's ``--grey``, in which a stopped member's state is drawn (``gone``, ``hung``, ``failed``: red)."""
NO_FIGURE = "\u2013"
"""What the page prints where it has no figure (an en dash)."""
TENANT_KEY = "dashboard-tenant-key-0123456789"
OPERATOR_KEY = "dashboard-operator-key-0123456789"

# Installs, once the page has loaded, a reader of what the dashboard shows and a recorder that keeps a
# reading of every update (the page rewrites its status line last in each one).
_INSTALL = """
const text = (id) => document.getElementById(id).textContent;
const read = () => ({
  status: text("status"),
  statusDown: document.getElementById("status").classList.contains("down"),
  keyForm: document.getElementById("key").classList.contains("shown"),
  tiles: Object.fromEntries(
    ["requests", "answered", "p50", "p99", "queue", "refused", "batch-size", "busy"].map((id) => [id, text(id)])),
  workers: Object.fromEntries(Array.from(document.querySelectorAll("#workers tr[data-worker]"), (tr) => [
    tr.dataset.worker, {state: tr.querySelector("td.state").textContent, busyPercent: tr.cells[4].textContent}])),
  others: Object.fromEntries(Array.from(document.querySelectorAll("#others tr[data-member]"), (tr) => [
    tr.dataset.member, tr.querySelector("td.state").textContent])),
  models: Array.from(document.querySelectorAll("#models tr[data-model]"), (tr) => tr.dataset.model),
});
const readings = [];
new MutationObserver(() => readings.push(read()))
  .observe(document.getElementById("status"), {childList: true, characterData: true, subtree: true});
window.dashboardTest = {read, readings};
"""


@dataclass
class Dashboard:
    """The dashboard page of the gateway at ``url``, as the browser shows it."""

    driver: WebDriver
    url: str

    def open(self, fragment: str = "") -> None:
        self.driver.get("about:blank")  # a fresh load: a change of fragment alone would not rerun the page
        self.driver.get(f"{self.url}/dashboard{fragment}")
        script(self.driver, _INSTALL)

    def read(self) -> dict[str, Any]:
        shown: dict[str, Any] = script(self.driver, "return window.dashboardTest.read()")
        return shown

    def readings(self) -> list[dict[str, Any]]:
        """A reading of every update since ``open``."""
        recorded: list[dict[str, Any]] = script(self.driver, "return window.dashboardTest.readings")
        return recorded

    def wait(
        self, check: Callable[[dict[str, Any]], object], what: str, timeout_s: float = 20.0, poll_s: float = 0.1
    ) -> dict[str, Any]:
        """The first reading for which ``check(reading)`` holds."""

        def holds(_: WebDriver) -> dict[str, Any] | None:
            shown = self.read()
            return shown if check(shown) else None

        try:
            return wait_for(self.driver, holds, what, timeout_s=timeout_s, poll_s=poll_s)
        except TimeoutException as err:
            raise AssertionError(f"{err}; the page shows {self.read()}") from None


def number(text: str) -> float | None:
    """A figure as the page prints it; None for its dash (no figure)."""
    return None if text in (NO_FIGURE, "") else float(text)


def live(shown: dict[str, Any]) -> bool:
    return str(shown["status"]).startswith("live")


def scrape(url: str) -> tuple[float, dict[str, float]]:
    """When (monotonic) ``/metrics`` was read, and each sample's sum over its labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    at = time.monotonic()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return at, sums


@contextmanager
def open_loop_load(url: str, rate: int, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``batchwire bench`` sending ``rate`` req/s of POST /v1/inference to ``url`` until the block ends."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHWIRE_")}
    with log_path.open("wb") as log:
        bench = subprocess.Popen(
            [sys.executable, "-m", "batchwire.cli", "bench", "--url", f"{url}/v1/inference", "--rate", str(rate),
             "--duration", "600", "--warmup", "0", "--lone", "0", "--warm", "0", "--no-metrics"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        yield bench
    finally:
        bench.terminate()
        bench.wait(10)


def save_screenshot(driver: WebDriver, tmp_path: Path) -> bytes:
    """The page as a PNG: always under ``tmp_path``, and where ``BATCHWIRE_SCREENSHOT`` says when it is set."""
    inner = script(driver, "return [document.documentElement.scrollHeight, window.outerHeight - window.innerHeight]")
    driver.set_window_size(WINDOW[0], sum(inner))  # the whole page, its last table included
    png = driver.get_screenshot_as_png()
    (tmp_path / "dashboard.png").write_bytes(png)
    wanted = os.environ.get(SCREENSHOT_ENV)
    if wanted:
        Path(wanted).write_bytes(png)
    return png


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    with chromium() as driver:
        yield driver


@pytest.fixture
def service(tmp_path: Path) -> Iterator[str]:
    proc: Proc
    proc, url = embedded(tmp_path, 2, SIM_LATENCY_MS)
    try:
        yield url
    finally:
        proc.stop()


@pytest.mark.timing  # it compares rates over seconds-long windows
def test_the_figures_move_under_load_and_agree_with_metrics(service: str, browser: WebDriver, tmp_path: Path) -> None:
    dashboard = Dashboard(browser, service)
    dashboard.open()
    # Opening the page is traffic of its own (the page, its favicon): the first update may count it.
    idle = dashboard.wait(
        lambda shown: live(shown) and shown["tiles"]["requests"] == "0.0" and len(shown["workers"]) == 2,
        "the idle fleet: two workers, no requests",
    )
    assert idle["tiles"]["busy"] == "0/2", idle
    assert all(worker["busyPercent"] == "0" for worker in idle["workers"].values()), idle

    load_log = tmp_path / "bench.log"
    with open_loop_load(service, LOAD_RPS, load_log):
        try:
            moving = dashboard.wait(
                lambda shown: (
                    (number(shown["tiles"]["requests"]) or 0) > 0
                    and all(int(worker["busyPercent"]) > 0 for worker in shown["workers"].values())
                ),
                "requests/s above 0 and both workers busy",
                timeout_s=30,
            )
        except AssertionError as err:
            raise AssertionError(f"{err}\nload generator: {load_log.read_text(errors='replace')[-2000:]}") from None
        assert len(moving["workers"]) == 2 and moving["models"] == ["sim"], moving

        first_at, first = scrape(service)
        skip = len(dashboard.readings())
        wait_for(browser, lambda _: len(dashboard.readings()) >= skip + READINGS, f"{READINGS} updates", timeout_s=30)
        last_at, last = scrape(service)
        readings = dashboard.readings()[skip:]
        if os.environ.get(SCREENSHOT_ENV):
            wait_for(
                browser,
                lambda _: len(dashboard.readings()) >= skip + SCREENSHOT_HISTORY_S,
                "history for the screenshot",
                timeout_s=3 * SCREENSHOT_HISTORY_S,
            )
        png = save_screenshot(browser, tmp_path)

    def median(tile: str) -> float:
        figures = [number(reading["tiles"][tile]) for reading in readings]
        assert None not in figures, f"every update under load shows {tile}: {[r['tiles'] for r in readings]}"
        return statistics.median(f for f in figures if f is not None)

    elapsed_s = last_at - first_at
    answered = "batchwire_request_latency_seconds_count"
    answered_rate = (last[answered] - first[answered]) / elapsed_s
    batches = last["batchwire_batch_size_count"] - first["batchwire_batch_size_count"]
    mean_batch = (last["batchwire_batch_size_sum"] - first["batchwire_batch_size_sum"]) / batches
    shown_answered, shown_batch = median("answered"), median("batch-size")
    shown_p50, shown_p99 = median("p50"), median("p99")
    print(
        f"\n{elapsed_s:.1f} s window: /metrics answered {answered_rate:.1f}/s, mean batch {mean_batch:.2f}; "
        f"dashboard (median of {len(readings)} updates) answered {shown_answered:.1f}/s, mean batch {shown_batch:.2f}, "
        f"p50 {shown_p50:.0f} ms, p99 {shown_p99:.0f} ms"
    )
    assert answered_rate > LOAD_RPS / 2, f"the load ran at {answered_rate:.1f} answers/s, not about {LOAD_RPS}"
    assert abs(shown_answered - answered_rate) <= TOLERANCE * answered_rate, (
        f"answered/s: the dashboard shows {shown_answered}, /metrics gives {answered_rate:.1f}"
    )
    assert abs(shown_batch - mean_batch) <= TOLERANCE * mean_batch, (
        f"mean batch size: the dashboard shows {shown_batch}, /metrics gives {mean_batch:.2f}"
    )
    # Each request waits at least one simulated batch; the page shows milliseconds.
    assert SIM_LATENCY_MS <= shown_p50 <= shown_p99, f"p50 {shown_p50} ms, p99 {shown_p99} ms"
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000, f"a screenshot of {len(png)} bytes"


def test_with_api_keys_the_page_is_open_and_only_an_operator_key_reads_the_fleet(
    tmp_path: Path, browser: WebDriver
) -> None:
    proc, url = embedded(tmp_path, 2, SIM_LATENCY_MS, "--api-keys", f"{TENANT_KEY},operator {OPERATOR_KEY}")
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            page = client.get("/dashboard")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page
            assert 'id="workers"' in page.text
            for path in ("/v1/fleet", "/dashboard/events"):
                refused = client.get(path)
                assert refused.status_code == 401, (path, refused.status_code, refused.text)
                tenant = client.get(path, headers={"Authorization": f"Bearer {TENANT_KEY}"})
                assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "forbidden", (path, tenant.text)
            operator = {"Authorization": f"Bearer {OPERATOR_KEY}"}

            def roles() -> set[str]:
                fleet = client.get("/v1/fleet", headers=operator)
                assert fleet.status_code == 200, fleet.text
                return {member["role"] for member in fleet.json()["members"]}

            eventually_sync(lambda: roles() == {"gateway", "batcher", "worker"}, "every role's first beat")
            with client.stream("GET", "/dashboard/events", headers=operator) as events:
                assert events.status_code == 200
                assert events.headers["content-type"].startswith("text/event-stream")
                first_event = next(line for line in events.iter_lines() if line.startswith("event:"))
            assert first_event == "event: fleet"

        dashboard = Dashboard(browser, url)
        dashboard.open()
        keyless = dashboard.wait(lambda shown: shown["keyForm"], "the page to ask for a key")
        assert keyless["statusDown"] and keyless["workers"] == {}, keyless

        dashboard.open(f"#key={TENANT_KEY}")
        tenant_page = dashboard.wait(lambda shown: shown["keyForm"], "the page to refuse a tenant key")
        assert "operator key" in tenant_page["status"] and tenant_page["workers"] == {}, tenant_page

        dashboard.open(f"#key={OPERATOR_KEY}")
        operator_page = dashboard.wait(lambda shown: live(shown) and len(shown["workers"]) == 2, "live figures")
        assert not operator_page["keyForm"], operator_page

        dashboard.open()  # no key again: the key typed into the page's form is used
        dashboard.wait(lambda shown: shown["keyForm"], "the page to ask for a key")
        browser.find_element(By.CSS_SELECTOR, "form#key input[name=key]").send_keys(OPERATOR_KEY)
        browser.find_element(By.CSS_SELECTOR, "form#key button").click()
        dashboard.wait(lambda shown: live(shown) and len(shown["workers"]) == 2, "live figures with the typed key")
    finally:
        proc.stop()


@pytest.mark.kafka
@pytest.mark.timing  # it bounds how soon a dead worker shows as gone
def test_a_worker_killed_with_kill_9_shows_as_gone_within_5_s(
    tmp_path: Path, infra: Any, browser: WebDriver, clusters: list[Cluster]
) -> None:
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=2, sim_latency_ms=SIM_LATENCY_MS)
    clusters.append(cluster)
    dashboard = Dashboard(browser, cluster.gateway_urls[0])
    dashboard.open()
    dashboard.wait(
        lambda shown: (
            all(shown["workers"].get(w, {}).get("state") in ("idle", "busy") for w in ("worker0", "worker1"))
            and set(shown["others"]) == {"gateway:gw0", "batcher:batcher0"}
        ),
        "the gateway, the batcher and both workers live on the page",
        timeout_s=30,
    )

    victim = proc_named(cluster, "worker0")
    killed_at = time.monotonic()
    victim.kill9()
    gone = dashboard.wait(
        lambda shown: shown["workers"].get("worker0", {}).get("state") == "gone",
        "worker0 to show as gone",
        timeout_s=30,
        poll_s=0.05,
    )
    gone_after_s = time.monotonic() - killed_at
    print(f"\nworker0 killed with kill -9: shown as gone {gone_after_s:.2f} s after")
    assert gone["workers"]["worker1"]["state"] in ("idle", "busy"), gone
    assert gone["tiles"]["busy"].endswith("/1"), f"one live worker left: {gone['tiles']}"
    assert gone_after_s <= GONE_WITHIN_S, f"worker0 showed as gone {gone_after_s:.2f} s after its kill -9"


@pytest.mark.kafka
def test_a_worker_stopped_with_sigterm_shows_as_stopped_not_gone(
    tmp_path: Path, infra: Any, browser: WebDriver, clusters: list[Cluster]
) -> None:
    """A planned stop reads apart from a crash: the worker's last beat shows it ``stopped`` (grey, not the
    red of ``gone``), past the 3 beats after which a silent member reads gone, and it is not counted live."""
    cluster = launch(tmp_path, infra.kafka_bootstrap, infra.redis_url, workers=2, sim_latency_ms=SIM_LATENCY_MS)
    clusters.append(cluster)
    url = cluster.gateway_urls[0]
    dashboard = Dashboard(browser, url)
    dashboard.open()
    dashboard.wait(
        lambda shown: all(shown["workers"].get(w, {}).get("state") in ("idle", "busy") for w in ("worker0", "worker1")),
        "both workers live on the page",
        timeout_s=30,
    )
    assert proc_named(cluster, "worker0").stop() == 0, "worker0 stops cleanly on SIGTERM"

    def silent_past_3_beats() -> bool:
        members = httpx.get(f"{url}/v1/fleet", timeout=10).json()["members"]
        return any(m["id"] == "worker0" and m["age_s"] > 3.5 for m in members)

    eventually_sync(silent_past_3_beats, "worker0's last beat to be over 3 beats old", timeout_s=30, interval_s=0.2)
    shown = dashboard.wait(
        lambda shown: shown["workers"].get("worker0", {}).get("state") == "stopped",
        "worker0 shown stopped, over 3 beats after its last beat",
        timeout_s=10,
    )
    assert shown["workers"]["worker1"]["state"] in ("idle", "busy"), shown
    assert shown["tiles"]["busy"].endswith("/1"), f"one live worker left: {shown['tiles']}"
    cell = "#workers tr[data-worker=worker0] td.state"
    color = script(browser, f"return getComputedStyle(document.querySelector('{cell}')).color")
    assert color == GREY, f"a stopped worker is no alarm: drawn {color}, not the page's grey {GREY}"


def test_an_operator_key_in_the_fragment_is_taken_as_written_plus_signs_and_all(
    tmp_path: Path, browser: WebDriver
) -> None:
    """Keys made by ``openssl rand -base64`` hold ``+`` and ``/``: ``/dashboard#key=<key>`` sends the key
    as written, not with each ``+`` read as a space (a query string's rule, which a fragment does not have)."""
    key = "dashboard+operator/key+0123456789="
    proc, url = embedded(tmp_path, 1, SIM_LATENCY_MS, "--api-keys", f"operator {key}")
    try:
        dashboard = Dashboard(browser, url)
        dashboard.open(f"#key={key}")
        shown = dashboard.wait(lambda shown: live(shown) or shown["keyForm"], "the page to take or refuse the key")
        assert live(shown) and not shown["keyForm"], shown
    finally:
        proc.stop()


def test_a_refused_stream_shows_the_servers_reason(tmp_path: Path, browser: WebDriver) -> None:
    """The page's stream is one of the gateway's watchers: at ``--max-watchers`` it is refused 503, and
    the page says why (the limit's name), not only "HTTP 503", and keeps trying."""
    proc, url = embedded(tmp_path, 1, SIM_LATENCY_MS, "--max-watchers", "1")
    try:
        with httpx.Client(base_url=url, timeout=10) as client, client.stream("GET", "/dashboard/events") as held:
            assert held.status_code == 200, held.status_code
            dashboard = Dashboard(browser, url)
            dashboard.open()
            shown = dashboard.wait(lambda shown: shown["statusDown"], "the page to say its stream is refused")
            assert "BATCHWIRE_MAX_WATCHERS" in shown["status"], shown
        dashboard.wait(live, "the page to follow the fleet once the other stream closed")
    finally:
        proc.stop()
