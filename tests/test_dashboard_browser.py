"""The dashboard in a real headless browser (Chromium, driven by Playwright) against a live mesh.

The page loads with its token in the URL (which sets its cookie, then leaves the address bar)
and shows the cluster; a job submitted during the test appears in the job table
and changes state on screen without a reload; its page opens and follows it to the end. A
screenshot is saved (to $GPUFLEET_ARTIFACTS when set, else the test's tmp dir).

Needs the `playwright` package (a dev dependency) and a Chromium binary: the Debian package
(`chromium`, which `.ci/run` installs) or $GPUFLEET_CHROMIUM. Skips, saying why, without them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gpufleet.shared.embedded.procs import free_port
from gpufleet.shared.runtime.bus import Bus
from gpufleet.tools.dashboard import Tokens, serve

from .helpers import default_cores, nodes_registered, running, submit_cmd, wait_until

TOKEN = "browser-test-admin-token-0123"


def chromium() -> str | None:
    for candidate in (os.environ.get("GPUFLEET_CHROMIUM"), "chromium", "chromium-browser", "chromium-headless-shell"):
        if candidate and (path := shutil.which(candidate)):
            return path
    return None


def artifact(tmp_path: Path, name: str) -> Path:
    out = Path(os.environ.get("GPUFLEET_ARTIFACTS", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    return out / name


def is_png(path: Path, min_bytes: int) -> bool:
    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= min_bytes


pytestmark = pytest.mark.skipif(chromium() is None, reason="no Chromium binary (apt-get install chromium)")


async def test_dashboard_in_headless_chromium(bus: Bus, nats_url: str, tmp_path: Path) -> None:
    pw = pytest.importorskip("playwright.async_api")
    port = free_port()
    _, server, follow = await serve(bus, "127.0.0.1", port, tokens=Tokens(admin=TOKEN), chart_step_s=1.0)
    try:
        async with running(nats_url, default_cores(sim_nodes=2)):
            await wait_until(lambda: nodes_registered(bus, 2))
            async with pw.async_playwright() as p:
                browser = await p.chromium.launch(executable_path=chromium(), headless=True,
                                                  args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
                try:
                    page = await browser.new_page(viewport={"width": 1280, "height": 900})
                    errors: list[str] = []
                    page.on("pageerror", lambda exc: errors.append(str(exc)))
                    # without the token: 401, saying how to give it, and nothing of the cluster
                    bare = await browser.new_page()
                    resp = await bare.goto(f"http://127.0.0.1:{port}/")
                    assert resp is not None and resp.status == 401 and "?token=" in await bare.inner_text("body")
                    await bare.close()
                    await page.goto(f"http://127.0.0.1:{port}/?token={TOKEN}")
                    assert TOKEN not in page.url  # out of the address bar (the cookie carries it now)
                    # the cluster map is drawn from the live state: two sim nodes, their GPUs free
                    await page.wait_for_function("document.querySelectorAll('#map .node').length == 2", timeout=15_000)
                    assert await page.locator("#map .gpu.free").count() > 0

                    job_id = "browser-job-1"
                    await bus.publish(submit_cmd({"name": "seen-in-browser", "tenant": "acme", "type": "batch",
                                                  "resources": {"gpu": 1, "cpu": 1, "memory": "1Gi"},
                                                  "sim": {"duration": "3s"}}, job_id=job_id))
                    row = page.locator(f'#recent tr[data-job="{job_id}"]')
                    await row.wait_for(timeout=15_000)  # it appears without a reload
                    # ...and changes state on screen: running (with a GPU shown allocated), then succeeded
                    await page.wait_for_function(
                        f"document.querySelector('#recent tr[data-job=\"{job_id}\"]')?.dataset.status == 'running'",
                        timeout=15_000)
                    assert await page.locator("#map .gpu.allocated").count() == 1
                    # a gang that needs every GPU waits for it: its page says why, from the log
                    await bus.publish(submit_cmd({"name": "whole-cluster", "tenant": "acme", "type": "batch",
                                                  "replicas": 2, "resources": {"gpu": 8, "cpu": 1, "memory": "1Gi"},
                                                  "sim": {"duration": "1s"}}, job_id="browser-gang"))
                    await page.locator('#recent tr[data-job="browser-gang"]').wait_for(timeout=15_000)
                    await page.click('#recent tr[data-job="browser-gang"] a')
                    await page.locator("#job .why").first.wait_for(timeout=10_000)
                    assert "pending (placement, seq" in await page.inner_text("#job")
                    await page.click(f'#recent tr[data-job="{job_id}"] a')  # its page, following it live
                    await page.wait_for_function(
                        "document.querySelector('#jobtitle').dataset.status == 'running'", timeout=10_000)
                    assert "job.placed" in await page.inner_text("#job")
                    await page.wait_for_function(
                        f"document.querySelector('#recent tr[data-job=\"{job_id}\"]')?.dataset.status == 'succeeded'",
                        timeout=20_000)
                    await page.wait_for_function(
                        "document.querySelector('#jobtitle').dataset.status == 'succeeded'", timeout=10_000)
                    timeline = await page.inner_text("#job")
                    assert "job.started" in timeline and "job.succeeded" in timeline
                    # the gang got the GPUs the first job gave back, then ended too: every GPU free again
                    await page.wait_for_function(
                        "document.querySelector('#recent tr[data-job=\"browser-gang\"]')?.dataset.status == 'succeeded'",
                        timeout=20_000)
                    assert await page.locator("#map .gpu.allocated").count() == 0
                    # the feed filter keeps only matching events
                    await page.fill("#filter", "job.succeeded")
                    feed = await page.inner_text("#feed")  # hidden rows are not in the text
                    assert "job.succeeded" in feed and "job.started" not in feed and "node.registered" not in feed
                    await page.fill("#filter", "")
                    assert "node.registered" in await page.inner_text("#feed")
                    # a direct link opens the job's page (the cookie is the token)
                    await page.goto(f"http://127.0.0.1:{port}/#job/{job_id}")
                    await page.wait_for_function(
                        "document.querySelector('#jobtitle').dataset.status == 'succeeded'", timeout=10_000)

                    # the charts, fed by the stream: a point a second here; what the jobs held and
                    # cost is on them, with a key per series, and the map has its legend
                    await page.wait_for_function(
                        "+document.querySelector('#c-alloc svg')?.dataset.points >= 5", timeout=15_000)
                    alloc = page.locator("#c-alloc polyline.series")
                    assert await alloc.count() >= 1
                    assert await page.locator('#c-cost polyline.series[data-series="acme"]').count() == 1
                    assert await page.locator('#c-pending polyline.series[data-series="default"]').count() == 1
                    assert await page.locator("#legend .gpu.unhealthy").count() == 1
                    assert "GPUs allocated, by model" in await page.inner_text("#charts")

                    shot = artifact(tmp_path, "dashboard.png")
                    await page.screenshot(path=str(shot), full_page=True)
                    assert is_png(shot, min_bytes=10_000)
                    assert errors == []  # no script error on the page
                finally:
                    await browser.close()
    finally:
        server.close()
        follow.cancel()
