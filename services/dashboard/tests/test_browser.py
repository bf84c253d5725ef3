"""The dashboard in a real browser against a real stack: a fault's incident and recovery appear without a reload.

Headless Chromium is Debian's (/usr/bin/chromium), driven by Playwright; when it is missing the session installs it
(as root, with apt) or skips with the reason. The stack is `reprise up`'s: 2 nodes + 1 spare, every service a process.
Screenshots of every page land in test-results/screenshots/.
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from reprise_cli.client import PlatformClient, poll
from reprise_cli.creds import ensure_read_api_key
from reprise_cli.servers import free_port, free_stack_ports
from reprise_cli.stack import Stack
from reprise_cli.topology import DEFAULT_PORTS, SLACK_RECEIVER_WEBHOOK, StackConfig
from reprise_dashboard.app import create_app
from reprise_dashboard.settings import DashboardSettings

pytestmark = pytest.mark.stack
ROOT = Path(__file__).resolve().parents[3]
SCREENSHOTS = ROOT / "test-results" / "screenshots"
CHROMIUM = Path("/usr/bin/chromium")
APT_TIMEOUT_S = 900
LIVE_WITHIN_MS = 5_000  # the incident must show on the open incidents page this soon after the fault
RECOVERY_STEPS = ["detected", "locked", "stopping_ranks", "isolating", "placing", "restoring", "launching",
                  "verifying", "running"]  # fmt: skip


def _apt(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(
        ["apt-get", *args], capture_output=True, text=True, timeout=APT_TIMEOUT_S, env=env, check=False
    )


@pytest.fixture(scope="session")
def chromium() -> Path:
    """Debian's Chromium, installed once per session when missing (root with apt); else the test is skipped."""
    if CHROMIUM.exists():
        return CHROMIUM
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"no {CHROMIUM} and no way to install it here: run `apt-get install chromium` as root")
    try:
        done = _apt("install", "-y", "-q", "chromium")
        if done.returncode != 0:  # a fresh machine may have no package lists yet
            _apt("update", "-q")
            done = _apt("install", "-y", "-q", "chromium")
    except subprocess.TimeoutExpired:
        pytest.skip(f"installing chromium took over {APT_TIMEOUT_S} s")
    if not CHROMIUM.exists():
        pytest.skip(f"`apt-get install chromium` failed: {(done.stderr or done.stdout)[-300:]}")
    return CHROMIUM


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`reprise up --nodes 2 --spares 1`, the dashboard included, on free ports."""
    state = tmp_path_factory.mktemp("dashboard-stack") / "state"
    config = StackConfig(nodes=2, spares=1, gpus_per_node=4, state_dir=state, ports=free_stack_ports(DEFAULT_PORTS))
    running = Stack(config, say=lambda _line: None)
    try:
        running.start(timeout_s=60)
    except BaseException:
        running.stop()
        raise
    yield running
    running.stop()


@pytest.fixture
def client(stack: Stack) -> Iterator[PlatformClient]:
    """The platform's REST client with the stack's admin key."""
    found = stack.client()
    yield found
    found.close()


def _open_live(context: Any, url: str) -> Any:
    """A page whose event stream is open, marked so that a reload would show (the mark would be gone)."""
    page = context.new_page()
    page.goto(url)
    page.wait_for_selector("body[data-live-state=open]", timeout=10_000)
    page.evaluate("window.__notReloaded = true")
    return page


def _sign_in(context: Any, dashboard: str, key: str) -> None:
    """Sign in the way a person does: a page sends the browser to /login, the key goes in the form."""
    page = context.new_page()
    page.goto(f"{dashboard}/incidents")
    assert "/login?next=" in page.url, page.url
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")
    page.wait_for_url(f"{dashboard}/incidents")
    page.close()


def _shot(page: Any, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


@pytest.mark.timeout(APT_TIMEOUT_S + 180)  # the first run on a fresh machine may install chromium
def test_a_fault_shows_live_in_the_browser(stack: Stack, client: PlatformClient, chromium: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (make venv)")
    dashboard = stack.url("dashboard")
    poll(client.nodes, lambda n: len(n) == 3, timeout_s=15)
    job = client.submit_job(name="dashboard-live", node_count=2, ranks_per_node=2)
    assert job["state"] == "running"

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), headless=True)
        context = browser.new_context(viewport={"width": 1440, "height": 900})
        _sign_in(context, dashboard, ensure_read_api_key(stack.config.state_dir))
        incidents = _open_live(context, f"{dashboard}/incidents")
        job_page = _open_live(context, f"{dashboard}/jobs/{job['id']}")
        assert job_page.locator("#recoveries").inner_text().count("No recovery yet") == 1

        injected = time.monotonic()
        drill = client.start_drill(job["id"], fault="xid79")  # the last rank's GPU falls off the bus
        row = incidents.locator(f"#incident-list tr:has(a[href='/jobs/{job['id']}'])")
        row.wait_for(timeout=LIVE_WITHIN_MS)
        print(f"incident on the open page {time.monotonic() - injected:.2f} s after the fault")
        assert incidents.evaluate("window.__notReloaded") is True
        assert f"{drill['node_id']} · GPU" in row.inner_text() and "gpu hardware" in row.inner_text()
        _shot(incidents, "incidents")

        job_page.wait_for_selector("svg.timeline g[data-step=running]", timeout=60_000)
        assert job_page.evaluate("window.__notReloaded") is True
        drawn = job_page.eval_on_selector_all("svg.timeline g.bar", "bars => bars.map(b => b.dataset.step)")
        assert drawn == RECOVERY_STEPS
        assert "recovered" in job_page.locator("#recoveries .recovery-head").inner_text()
        # The drill's verdict follows the recovery's last event, so no event announces it: reload for it.
        poll(lambda: client.drill(drill["id"]), lambda d: d["state"] != "running", timeout_s=30)
        job_page.reload()
        assert job_page.locator(f"#drills tr[data-key='{drill['id']}'] .badge").inner_text() in ("passed", "missed")
        _shot(job_page, "job")

        _check_other_pages(context, dashboard, job["id"], drill)
        browser.close()


def _check_other_pages(context: Any, dashboard: str, job_id: str, drill: dict[str, Any]) -> None:
    """Overview, incident, nodes and alerts show the fault's aftermath; a screenshot of each."""
    culprit = drill["node_id"]
    page = context.new_page()
    page.goto(f"{dashboard}/")
    row = page.locator(f"#jobs tr[data-key='{job_id}']")
    cells = row.locator("td").all_inner_texts()
    assert cells[1].startswith("running") and cells[3] == "1", cells  # state, restarts
    assert cells[4].endswith("%") and not cells[4].startswith("100.0"), cells  # the recovery cost some goodput
    assert "XID 79" in cells[7] or "GPU" in cells[7], cells
    _shot(page, "overview")

    row.locator("td").nth(7).locator("a").click()
    page.wait_for_selector("#linked-recovery svg.timeline")
    head = page.locator("#incident-head").inner_text()
    assert culprit in head and f"rank {drill['rank']}" in head and "GPU" in head, head
    assert page.locator("#evidence .symptom").count() >= 1
    assert f"rank {drill['rank']} step" in page.content()  # the dead rank's last lines, as evidence
    _shot(page, "incident")

    page.goto(f"{dashboard}/nodes")
    node = page.locator(f"#node-{culprit}")
    assert "cordoned" in node.inner_text()
    assert node.locator(".gpu.health-ok").count() < 4  # the GPU that fell off the bus is not ok
    _shot(page, "nodes")

    page.goto(f"{dashboard}/alerts")
    text = page.locator("main").inner_text()
    assert "Notifier unavailable" not in text and SLACK_RECEIVER_WEBHOOK not in page.content()
    _shot(page, "alerts")


async def test_pages_from_the_stack_over_http(stack: Stack) -> None:
    viewer = {"Authorization": f"Bearer {ensure_read_api_key(stack.config.state_dir)}"}
    async with httpx.AsyncClient(base_url=stack.url("dashboard"), timeout=10) as bare:
        assert (await bare.get("/")).status_code == 303  # nobody signed in: sent to /login
    async with httpx.AsyncClient(base_url=stack.url("dashboard"), timeout=10, headers=viewer) as http:
        missing = await http.get("/jobs/job-none")
        assert missing.status_code == 404 and "knows no job job-none" in missing.text
        assert (await http.get("/incidents/inc0none")).status_code == 404
        assert (await http.get("/incidents?state=bogus")).text.count("Detector unavailable") == 1  # its 422, shown

    wrong_key = DashboardSettings(
        nats_url=f"nats://127.0.0.1:{free_port()}",
        orchestrator_url=stack.url("orchestrator"),
        detector_url=stack.url("detector"),
        read_api_key="rpk_nobody_" + "x" * 43,
        viewer_auth="off",
    )
    app = create_app(wrong_key)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dashboard") as local,
    ):
        page = html.unescape((await local.get("/")).text)
    assert "Orchestrator unavailable</strong> — the orchestrator refused the dashboard's API key (401)" in page
