"""The job page in a real browser: Debian's chromium driven by Playwright, against uvicorn, Redis and a worker.

A person's path through the page: give the token, start a job with progress (a transcode of a 30 s
clip; the probe when the transcode kind is absent), watch its bar reach 100 % and open its result;
send a job that fails, replay it from the dead-letter queue; pause and resume a queue; browse every queue's jobs by
state, including jobs the page did not start, and cancel one; start a flow, watch its steps succeed one after the other
and open a step's job, and cancel a running flow. Screenshots of the page go to test-artifacts/. The
browser is the system's (`scripts/ensure-system-deps` installs it); nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from pipeline.constants import DELAYED_DEST_KEY, DELAYED_KEY, DELAYED_MESSAGE_KEY, PAUSED_KEY
from pipeline.status import job_status
from tasks.probe import probe
from tests.support.api import TEST_APP, ApiServer
from tests.support.inproc import InProcessWorker
from tests.support.media import make_clip
from tests.support.procs import ROOT, RedisServer, Worker, wait_for
from tests.support.worker_app import run_records

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture(scope="module")
def api(session_worker: InProcessWorker, transcode_worker: Worker, work_dir: Path) -> Iterator[ApiServer]:
    server = ApiServer("page", work_dir / "logs").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield launched
        launched.close()


@contextmanager
def open_page(browser: Browser, server: ApiServer) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1360, "height": 1000}, base_url=server.url)
    page = context.new_page()
    page.set_default_timeout(60_000)
    problems: list[str] = []
    # The sign-in step tries a wrong token on purpose; its 401 is the one error the console may show.
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" and "401" not in m.text else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    yield page
    context.close()
    assert problems == [], f"errors in the page (script errors or CSP violations): {problems}"


@pytest.fixture
def page(browser: Browser, api: ApiServer) -> Iterator[Page]:
    with open_page(browser, api) as opened:
        yield opened


@pytest.fixture(scope="module")
def flows_api(session_worker: InProcessWorker, work_dir: Path) -> Iterator[ApiServer]:
    """The API with the test flows declared too (test_chain, test_fan), as the API of a deployment declaring them."""
    server = ApiServer("page-flows", work_dir / "logs", app=TEST_APP).start()
    yield server
    server.stop()


@pytest.fixture
def flows_page(browser: Browser, flows_api: ApiServer) -> Iterator[Page]:
    with open_page(browser, flows_api) as opened:
        yield opened


def sign_in(page: Page, api: ApiServer) -> None:
    page.goto("/")
    dialog = page.locator("#token-dialog")
    expect(dialog).to_be_visible()
    page.fill("#token-input", "not-the-token-0000")
    page.click("#token-form button[type=submit]")
    expect(page.locator("#token-error")).to_contain_text("not valid")
    page.fill("#token-input", api.token)
    page.click("#token-form button[type=submit]")
    expect(dialog).to_be_hidden()
    expect(page.locator("#kinds .kind").first).to_be_visible()


def enqueue(page: Page, kind: str, payload: dict[str, object] | None = None) -> str:
    """Start a job from the form (the kind's example when `payload` is None); return its id."""
    page.click(f"#kinds .kind[data-kind='{kind}']")
    if payload is not None:
        page.fill("#payload", json.dumps(payload))
    before = page.locator("#job-list li").count()
    page.click("#enqueue")
    expect(page.locator("#form-message")).to_contain_text("Accepted")
    expect(page.locator("#job-list li")).to_have_count(before + 1)
    return str(page.locator("#job-list li").first.get_attribute("data-id"))


def test_start_a_job_watch_it_finish_and_replay_a_dead_letter(page: Page, api: ApiServer, clean_dlq: None) -> None:
    sign_in(page, api)
    kinds = page.locator("#kinds .kind").evaluate_all("els => els.map(e => e.dataset.kind)")
    assert "probe" in kinds

    # A job with progress: record every value its progress bar shows.
    with_progress = "transcode" if "transcode" in kinds else "probe"
    if with_progress == "transcode":  # long enough for ffmpeg to report progress several times
        payload = {"source_uri": make_clip("browser-clip.mp4", 30, "1280x720").name, "preset": "720p"}
    else:
        payload = {"message": "from the browser", "sleep_s": 4, "progress_steps": 8}
    job_id = enqueue(page, with_progress, payload)
    page.evaluate(
        """id => {
            window.__seen = [];
            const list = document.getElementById('job-list');
            new MutationObserver(() => {
                const bar = list.querySelector(`li[data-id="${id}"] [role=progressbar]`);
                if (bar) window.__seen.push(Number(bar.getAttribute('aria-valuenow')));
            }).observe(list, {subtree: true, childList: true, attributes: true});
        }""",
        job_id,
    )
    # (page.wait_for_function would evaluate a string, which the page's CSP rightly forbids.)
    wait_for(lambda: any(0 < v < 100 for v in page.evaluate("window.__seen")), 120, 0.1, what="a bar in progress")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "api-page-running.png"))
    row = page.locator(f"#job-list li[data-id='{job_id}']")
    expect(row.locator(".badge")).to_have_text("succeeded", timeout=120_000)
    expect(row.locator("[role=progressbar]")).to_have_attribute("aria-valuenow", "100")
    expect(row.locator(".percent")).to_have_text("100 %")
    seen = page.evaluate("window.__seen")
    assert any(0 < v < 100 for v in seen), f"the bar never showed progress between 0 and 100: {seen}"
    assert seen == sorted(seen)
    row.click()
    expect(page.locator("#detail")).to_be_visible()
    expect(page.locator("#detail-facts")).to_contain_text("succeeded")
    if with_progress == "probe":
        expect(page.locator("#detail-output")).to_contain_text('"message": "from the browser"')
    else:
        expect(page.locator("#detail-output")).to_contain_text('"height": 720')
        expect(page.locator("#detail-output")).to_contain_text("browser-clip-720p.mp4")

    # A job that fails for good lands in the dead-letter queue; replay it from there.
    failing = enqueue(page, "probe", {"message": "bound to fail", "fail": "permanent"})
    expect(page.locator(f"#job-list li[data-id='{failing}'] .badge")).to_have_text("dead lettered")
    page.click("#dlq-refresh")
    entry = page.locator(f"#dlq-rows tr[data-task-id='{failing}']")
    expect(entry).to_be_visible()
    expect(entry).to_contain_text("PermanentError")
    entry_id = entry.get_attribute("data-id")
    entry.get_by_role("button", name="Replay").click()
    expect(page.locator("#form-message")).to_contain_text("Replayed as job")
    expect(page.locator(f"#dlq-rows tr[data-id='{entry_id}']")).to_have_count(0)
    replayed = str(page.locator("#job-list li").first.get_attribute("data-id"))
    assert replayed not in (failing, job_id)
    # The replay ran the same payload again, so it fails again: a new entry for the new job.
    expect(page.locator(f"#job-list li[data-id='{replayed}'] .badge")).to_have_text("dead lettered")
    page.click("#dlq-refresh")
    expect(page.locator(f"#dlq-rows tr[data-task-id='{replayed}']")).to_be_visible()

    page.locator(f"#job-list li[data-id='{job_id}']").click()
    expect(page.locator("#detail-id")).to_have_text(job_id)
    page.screenshot(path=str(ARTIFACTS / "api-page.png"), full_page=True)
    assert (ARTIFACTS / "api-page.png").stat().st_size > 10_000


def test_the_token_is_kept_for_the_tab_only(page: Page, api: ApiServer) -> None:
    sign_in(page, api)
    assert page.evaluate("sessionStorage.getItem('pipeline.token')") == api.token
    assert page.evaluate("localStorage.length") == 0
    assert api.token not in page.evaluate("document.cookie")
    page.reload()
    expect(page.locator("#token-dialog")).to_be_hidden()  # same tab: still signed in
    other = page.context.new_page()  # a new tab has its own sessionStorage
    other.goto("/")
    expect(other.locator("#token-dialog")).to_be_visible()
    other.close()
    page.click("#sign-out")
    expect(page.locator("#token-dialog")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('pipeline.token')") is None


def test_the_job_browser_lists_every_queues_jobs_by_state(
    page: Page, api: ApiServer, redis_server: RedisServer, clean_dlq: None
) -> None:
    # Jobs this page never started, enqueued from this process: parked ones (more than a page), one that
    # succeeds, one that is dead-lettered.
    parked = [probe.enqueue({"message": f"later {i}"}, countdown=3600 + i) for i in range(25)]
    try:
        done = probe.enqueue({"message": "enqueued elsewhere"})
        doomed = probe.enqueue({"message": "enqueued elsewhere, failing", "fail": "permanent"})
        probe.result(done, timeout=60)
        wait_for(lambda: job_status(doomed).state == "dead_lettered", 60, 0.1, what="a dead-lettered job")

        sign_in(page, api)
        # Pause a queue from its chip in the header, then resume it.
        chip = page.locator("#queues li[data-queue='webhooks']")
        expect(chip).to_have_attribute("data-state", "running")
        expect(page.locator("#queues li[data-queue='dead_letter'] button")).to_have_count(0)  # no consumer to pause
        chip.get_by_role("button", name="Pause webhooks").click()
        expect(chip).to_have_attribute("data-state", "paused")
        expect(chip).to_contain_text("paused")
        assert redis_server.client().sismember(PAUSED_KEY, "webhooks")
        chip.get_by_role("button", name="Resume webhooks").click()
        expect(chip).to_have_attribute("data-state", "running")
        assert not redis_server.client().sismember(PAUSED_KEY, "webhooks")

        scheduled = page.locator("#counts-rows button[data-queue='default'][data-state='scheduled']")
        expect(scheduled).not_to_have_text("0")
        assert int(scheduled.inner_text()) >= len(parked)
        scheduled.click()
        expect(page.locator("#browser-list-title")).to_contain_text("scheduled in default")
        rows = page.locator("#browser-rows tr")
        expect(rows).to_have_count(20)  # a page
        seen = rows.evaluate_all("trs => trs.map(tr => tr.dataset.id)")
        expect(page.locator("#browser-first")).to_be_disabled()
        while page.locator("#browser-next").is_enabled():
            first = rows.first.get_attribute("data-id")
            page.click("#browser-next")
            expect(rows.first).not_to_have_attribute("data-id", str(first))
            seen += rows.evaluate_all("trs => trs.map(tr => tr.dataset.id)")
        assert set(parked) <= set(seen) and len(seen) == len(set(seen))
        expect(page.locator("#browser-position")).not_to_have_text("page 1")
        page.click("#browser-first")
        expect(page.locator("#browser-position")).to_have_text("page 1")

        # Cancel a scheduled job from its detail: it leaves the scheduled list and is counted as cancelled.
        victim = str(rows.first.get_attribute("data-id"))
        rows.first.click()
        expect(page.locator("#detail-id")).to_have_text(victim)
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#detail-cancel")
        expect(page.locator("#detail-facts")).to_contain_text("cancelled")
        expect(page.locator("#detail-cancel")).to_have_count(0)  # final: nothing left to cancel
        expect(page.locator(f"#browser-rows tr[data-id='{victim}']")).to_have_count(0)
        expect(page.locator("#counts-rows button[data-queue='default'][data-state='cancelled']")).not_to_have_text("0")
        assert job_status(victim).state == "cancelled"

        page.click("#counts-rows button[data-queue='default'][data-state='succeeded']")
        expect(page.locator("#browser-list-title")).to_contain_text("succeeded in default")
        row = page.locator(f"#browser-rows tr[data-id='{done}']")
        expect(row).to_contain_text("pipeline.probe")
        row.click()
        expect(page.locator("#detail-id")).to_have_text(done)
        expect(page.locator("#detail-facts")).to_contain_text("succeeded")
        expect(page.locator("#detail-output")).to_contain_text('"message": "enqueued elsewhere"')

        page.click("#counts-rows button[data-queue='default'][data-state='dead_lettered']")
        row = page.locator(f"#browser-rows tr[data-id='{doomed}']")
        expect(row).to_contain_text("PermanentError")
        assert "enqueued elsewhere" not in page.locator("#browser-rows").inner_text()  # no payloads in the list
        row.click()
        expect(page.locator("#detail-id")).to_have_text(doomed)
        expect(page.locator("#detail-facts")).to_contain_text("dead lettered")
        expect(page.locator("#detail-output")).to_contain_text("PermanentError")

        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "api-page-jobs.png"
        page.locator("#browser").screenshot(path=str(shot))
        print(f"job browser screenshot: {shot}")
        assert shot.stat().st_size > 5_000
    finally:
        client = redis_server.client()
        client.srem(PAUSED_KEY, "webhooks")
        client.zrem(DELAYED_KEY, *parked)
        client.hdel(DELAYED_MESSAGE_KEY, *parked)
        client.hdel(DELAYED_DEST_KEY, *parked)


def test_start_a_flow_watch_its_steps_and_cancel_another(
    flows_page: Page, flows_api: ApiServer, redis_server: RedisServer
) -> None:
    page = flows_page
    sign_in(page, flows_api)
    expect(page.locator("#flow-name option[value='invoice']")).to_have_count(1)
    assert json.loads(page.input_value("#flow-input")) == page.evaluate(
        "fetch('/flows/kinds', {headers: {Authorization: `Bearer ${sessionStorage.getItem('pipeline.token')}`}})"
        ".then(r => r.json()).then(ks => ks.find(k => k.name === 'invoice').example)"
    )  # the selected flow's example input, ready to start

    # A fan-out of three items, then its join: record every state each step's badge shows.
    page.select_option("#flow-name", "test_fan")
    expect(page.locator("#flow-desc")).to_contain_text("split (test.run, each), join (test.ledger) after split")
    page.evaluate(
        """() => {
            window.__steps = {};
            new MutationObserver(() => {
                for (const tr of document.querySelectorAll('#flow-steps tr')) {
                    const seen = (window.__steps[tr.dataset.step] ||= []);
                    const text = tr.querySelector('.badge').textContent;
                    if (seen[seen.length - 1] !== text) seen.push(text);
                }
            }).observe(document.getElementById('flow-steps'), {subtree: true, childList: true});
        }"""
    )
    key = uuid.uuid4().hex
    page.fill("#flow-input", json.dumps({"key": key, "n": 3, "sleep_s": 0.3}))
    page.click("#flow-start")
    expect(page.locator("#flow-message")).to_contain_text("Started: flow")
    expect(page.locator("#flow-view")).to_be_visible()
    flow_id = page.inner_text("#flow-view-id")
    expect(page.locator("#flow-state")).to_have_text("succeeded", timeout=60_000)
    expect(page.locator("#flow-cancel")).to_be_hidden()
    split, join = page.locator("#flow-steps tr[data-step='split']"), page.locator("#flow-steps tr[data-step='join']")
    expect(split.locator(".jobs")).to_have_text("3/3")
    expect(split.locator("[role=progressbar]")).to_have_attribute("aria-valuenow", "100")
    expect(join.locator(".badge")).to_have_text("succeeded")
    steps = page.evaluate("window.__steps")
    assert steps["join"][0] == "waiting for split" and steps["join"][-1] == "succeeded", steps
    assert steps["split"][-1] == "succeeded", steps
    listed = page.locator(f"#flow-list li[data-id='{flow_id}']")
    expect(listed.locator(".badge")).to_have_text("succeeded", timeout=10_000)  # the list's next refresh
    expect(listed.locator("[role=progressbar]")).to_have_attribute("aria-valuenow", "100")
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#flows").screenshot(path=str(ARTIFACTS / "api-page-flows.png"))

    # A step's job opens in the job view.
    job = split.locator(".job-link").first
    job_id = str(job.get_attribute("data-id"))
    job.click()
    expect(page.locator("#detail-id")).to_have_text(job_id)
    expect(page.locator("#detail-facts")).to_contain_text("test.run")

    # A flow whose only item runs until released: cancel it from its view.
    other = uuid.uuid4().hex
    try:
        page.fill("#flow-input", json.dumps({"key": other, "n": 1, "ends": "release"}))
        page.click("#flow-start")
        expect(page.locator("#flow-view-id")).not_to_have_text(flow_id)
        wait_for(lambda: any(r["event"] == "start" for r in run_records(other)), 20, 0.05, what="the item to start")
        expect(page.locator("#flow-state")).to_have_text("running")
        expect(page.locator("#flow-steps tr[data-step='join'] .badge")).to_have_text("waiting for split")
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#flow-cancel")
        expect(page.locator("#flow-state")).to_have_text("cancelled")
        expect(page.locator("#flow-steps tr[data-step='split'] .badge")).to_have_text("cancelled")
        expect(page.locator("#flow-cancel")).to_be_hidden()
        expect(page.locator("#flow-message")).to_contain_text("Cancelled flow")
    finally:
        redis_server.client().set(f"test:release:{other}", "1")
