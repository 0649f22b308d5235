"""The operators' dashboard in a real headless Chromium, on an embedded Valkey, with real workers.

A poison message shows under its group with its reason; a redrive from the page makes the fixed
handler process it; a bulk purge removes exactly the entries the page showed, not one that came
after; a read-only dashboard refuses every action; a request without the token is refused off
loopback; a cross-origin POST is refused. The tests take the screenshots of docs/dashboard.md
(written to docs/img only with FRAMEWORK_SCREENSHOTS=docs/img).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog.testing

from framework import SyncClient
from framework.dashboard import create_app
from tests.conftest import run_cli
from tests.dashboard_support import SHOTS, Served, chromium_or_skip, dead_letters, outside_address
from tests.workers import Workers, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def browser() -> Iterator[Any]:
    path = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def serve(redis_url: str, namespace: str) -> Iterator[Any]:
    served: list[Served] = []

    def start(host: str = "127.0.0.1", **options: Any) -> Served:
        s = Served(create_app(redis_url, namespace, **options), host=host)
        served.append(s)
        return s

    yield start
    for s in served:
        s.close()


def _charge(redis_url: str, namespace: str, *order_ids: str) -> None:
    with SyncClient(redis_url, namespace=namespace) as client:
        for oid in order_ids:
            client.send("dash.charges", {"order_id": oid, "card_number": "4111111111111111", "amount_cents": 1250})


def _worker(workers: Workers, tmp_path: Path, name: str, fixed: bool) -> subprocess.Popen[bytes]:
    env = {"DASH_DONE": str(tmp_path / "done.txt"), **({"DASH_FIXED": "1"} if fixed else {})}
    proc = workers.start("dashapp:payments", name, **env)
    # (it declares dash.charges with its 2 partitions: a send before would declare it with 1)
    wait_for(lambda: "runtime started" in workers.log(name), 30, f"worker {name} to start")
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()  # SIGTERM: a graceful stop (the worker leaves its heartbeat)
    proc.wait(30)


def test_poison_shows_with_its_reason_and_a_redrive_from_the_page_is_processed(
    browser: Any, serve: Any, workers: Workers, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    broken = _worker(workers, tmp_path, "w-broken", fixed=False)
    _charge(redis_url, namespace, "o-1")
    wait_for(lambda: len(dead_letters(redis_url, namespace)) == 1, 30, "the poison message to be dead-lettered")
    app = serve(actions=True)
    page = browser.new_page(viewport={"width": 1300, "height": 800})
    violations: list[str] = []
    page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
    page.goto(app.url + "/")
    row = page.locator('#services tr[data-group="payments"]')
    assert row.locator(".live-workers").inner_text() == "1"
    assert page.locator('#workers tr[data-worker="w-broken"]').inner_text().startswith("w-broken\tlive")
    owners = page.locator("#owners tbody tr")
    assert owners.count() == 2 and all("w-broken" in t for t in owners.all_inner_texts())  # both partitions
    page.screenshot(path=str(SHOTS / "dashboard-overview.png"), full_page=True)

    _stop(broken)  # a stopped worker is shown as gone, not counted
    page.goto(app.url + "/")
    assert page.locator('#services tr[data-group="payments"] .live-workers').inner_text() == "0"
    assert "gone" in page.locator('#workers tr[data-worker="w-broken"]').inner_text()

    page.goto(app.url + "/dead-letters")
    entry = page.locator("#entries tbody tr")
    assert entry.count() == 1
    assert "dash.charges / payments" in entry.inner_text()
    assert "card declined for order o-1" in entry.inner_text()
    assert "CardDeclined" in page.locator("#classes").inner_text()
    page.screenshot(path=str(SHOTS / "dashboard-dead-letters.png"), full_page=True)

    entry.locator("a").click()
    assert "card declined for order o-1" in page.locator("#reason").inner_text()
    body = page.locator("#body").inner_text()
    assert "4111111111111111" not in body and "[redacted]" in body and "o-1" in body
    page.screenshot(path=str(SHOTS / "dashboard-message.png"), full_page=True)

    _worker(workers, tmp_path, "w-fixed", fixed=True)
    page.locator("#redrive-one").click()
    assert page.locator("#count").get_attribute("data-count") == "1"
    page.locator("#confirm").click()
    page.wait_for_selector('#job[data-finished="yes"]', timeout=20_000)
    assert "done: 1 of 1 redriven" in page.locator("#result").inner_text()
    page.screenshot(path=str(SHOTS / "dashboard-job.png"), full_page=True)
    done = tmp_path / "done.txt"
    wait_for(lambda: done.exists() and done.read_text().split() == ["o-1"], 30, "the fixed handler to process o-1")
    assert dead_letters(redis_url, namespace) == []
    assert violations == []  # htmx and the pages run under the strict CSP


def test_a_scheduled_message_is_cancelled_from_the_page(
    browser: Any, serve: Any, workers: Workers, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    _worker(workers, tmp_path, "w-fixed", fixed=True)
    with SyncClient(redis_url, namespace=namespace) as client:
        for oid in ("s-1", "s-2"):
            client.send("dash.charges", {"order_id": oid, "card_number": "4111", "amount_cents": 5}, delay=3600)
    app = serve(actions=True)
    page = browser.new_page(viewport={"width": 1300, "height": 600})
    page.goto(app.url + "/scheduled")
    rows = page.locator("#scheduled tbody tr")
    assert rows.count() == 2 and "4111" not in page.content()
    page.screenshot(path=str(SHOTS / "dashboard-scheduled.png"), full_page=True)
    first = rows.first.get_attribute("data-message-id")
    rows.first.locator("button").click()
    assert page.locator("#notice").inner_text() == "cancelled"
    left = page.locator("#scheduled tbody tr")
    assert left.count() == 1 and left.first.get_attribute("data-message-id") != first


def test_bulk_purge_removes_exactly_the_entries_shown(
    browser: Any, serve: Any, workers: Workers, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    _worker(workers, tmp_path, "w-broken", fixed=False)
    _charge(redis_url, namespace, "a-1", "a-2", "a-3")
    wait_for(lambda: len(dead_letters(redis_url, namespace)) == 3, 30, "three dead letters")
    app = serve(actions=True)
    page = browser.new_page(viewport={"width": 1300, "height": 800})
    page.goto(app.url + "/dead-letters?group=payments")
    shown = set(page.locator("#entries tbody tr").evaluate_all("rows => rows.map(r => r.dataset.messageId)"))
    assert len(shown) == 3
    _charge(redis_url, namespace, "b-1", "b-2")  # after the page loaded: not part of what was shown
    wait_for(lambda: len(dead_letters(redis_url, namespace)) == 5, 30, "five dead letters")
    page.locator("#purge-all").click()
    assert page.locator("#count").get_attribute("data-count") == "3"
    page.screenshot(path=str(SHOTS / "dashboard-confirm.png"), full_page=True)
    with structlog.testing.capture_logs() as logged:
        page.locator("#confirm").click()
        page.wait_for_selector('#job[data-finished="yes"]', timeout=20_000)
    assert "done: 3 of 3 purged" in page.locator("#result").inner_text()
    [entry] = [e for e in logged if e.get("action") == "dlq.purge"]  # the audit log: who and what
    assert entry["who"] == "anonymous@127.0.0.1" and entry["asked"] == entry["purged"] == 3
    assert len(entry["refs"]) == 3 and all(r.startswith("dash.charges/") for r in entry["refs"])
    left = dead_letters(redis_url, namespace)
    assert sorted(json.loads(d.body)["order_id"] for d in left) == ["b-1", "b-2"]
    assert not shown & {d.message_id for d in left}


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert m, "no CSRF token on the page"
    return m.group(1)


def test_a_read_only_dashboard_refuses_every_action(
    serve: Any, workers: Workers, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    _worker(workers, tmp_path, "w-broken", fixed=False)
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with SyncClient(redis_url, namespace=namespace) as client:
        headers = {"traceparent": f"00-{trace}-00f067aa0ba902b7-01"}
        client.send("dash.charges", {"order_id": "r-1", "card_number": "4", "amount_cents": 1}, headers=headers)
    wait_for(lambda: len(dead_letters(redis_url, namespace)) == 1, 30, "a dead letter")
    ref = dead_letters(redis_url, namespace)[0].ref
    app = serve(actions=False, trace_url="http://jaeger.example/trace/{trace_id}")
    html = httpx.get(app.url + "/dead-letters").text
    assert "card declined for order r-1" in html
    assert "Redrive" not in html and "Purge" not in html
    message = httpx.get(app.url + "/dead-letters/message", params={"ref": ref}).text
    assert f'href="http://jaeger.example/trace/{trace}"' in message  # the trace id, linked
    assert "Redrive" not in message and "Purge" not in message
    origin = {"origin": app.url}
    for path, form in (
        ("/dead-letters/confirm", {"action": "purge", "refs": ref}),
        ("/dead-letters/apply", {"action": "purge", "refs": ref}),
        ("/dead-letters/apply", {"action": "redrive", "refs": ref}),
        ("/scheduled/cancel", {"id": "x"}),
    ):
        r = httpx.post(app.url + path, data=form, headers=origin)
        assert r.status_code == 403 and "read-only" in r.text, (path, r.status_code, r.text)
    for method in ("PUT", "DELETE", "PATCH"):
        assert httpx.request(method, app.url + "/dead-letters/apply").status_code in (403, 405)
    assert [d.ref for d in dead_letters(redis_url, namespace)] == [ref]


def test_cross_origin_and_tokenless_posts_are_refused(
    serve: Any, workers: Workers, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    _worker(workers, tmp_path, "w-broken", fixed=False)
    _charge(redis_url, namespace, "c-1")
    wait_for(lambda: len(dead_letters(redis_url, namespace)) == 1, 30, "a dead letter")
    ref = dead_letters(redis_url, namespace)[0].ref
    app = serve(actions=True)
    page = httpx.get(app.url + "/dead-letters")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert "'unsafe-inline'" not in page.headers["content-security-policy"]
    csrf = _csrf(page.text)
    form = {"action": "purge", "refs": ref, "csrf": csrf}
    evil = httpx.post(app.url + "/dead-letters/apply", data=form, headers={"origin": "http://evil.example"})
    assert evil.status_code == 403 and "dashboard's pages" in evil.text
    cross = httpx.post(
        app.url + "/dead-letters/apply", data=form, headers={"origin": app.url, "sec-fetch-site": "cross-site"}
    )
    assert cross.status_code == 403
    no_origin = httpx.post(app.url + "/dead-letters/apply", data=form)
    assert no_origin.status_code == 403
    no_csrf = httpx.post(app.url + "/dead-letters/apply", data={**form, "csrf": ""}, headers={"origin": app.url})
    assert no_csrf.status_code == 403 and "CSRF" in no_csrf.text
    assert [d.ref for d in dead_letters(redis_url, namespace)] == [ref]  # nothing was purged
    ok = httpx.post(app.url + "/dead-letters/confirm", data=form, headers={"origin": app.url})
    assert ok.status_code == 200 and 'data-count="1"' in ok.text


def test_off_loopback_a_request_without_the_token_is_refused(serve: Any, redis_url: str, namespace: str) -> None:
    refused = run_cli("dashboard", "--host", "0.0.0.0", "--broker-url", redis_url, "--namespace", namespace)
    assert refused.returncode == 2 and "without an access token" in refused.stderr
    addr = outside_address()
    if addr is None:
        pytest.skip("this machine has no address but loopback")
    open_app = serve(host="0.0.0.0")
    r = httpx.get(f"http://{addr}:{open_app.port}/")
    assert r.status_code == 403 and "loopback" in r.text
    token = "t0ken-" + "x" * 20
    guarded = serve(host="0.0.0.0", token=token)
    outside = f"http://{addr}:{guarded.port}"
    assert httpx.get(outside + "/").status_code == 401
    assert httpx.get(outside + "/", headers={"authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.get(outside + "/", headers={"authorization": f"Bearer {token}"})
    assert ok.status_code == 200 and "Overview" in ok.text
    with httpx.Client(base_url=outside, follow_redirects=True) as browser_like:
        assert browser_like.get(f"/dead-letters?token={token}").status_code == 200  # the cookie it sets
        assert browser_like.get("/").status_code == 200


def test_status_json_counts_live_workers_from_heartbeats(
    serve: Any, workers: Workers, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    proc = _worker(workers, tmp_path, "w-one", fixed=True)
    env = {"REDIS_URL": redis_url, "FRAMEWORK_NAMESPACE": namespace}

    def group() -> dict[str, Any]:
        out = run_cli("status", "--json", env=env)
        assert out.returncode == 0, out.stderr
        dest = [d for d in json.loads(out.stdout) if d["name"] == "dash.charges"]
        return dest[0]["groups"][0] if dest and dest[0]["groups"] else {}

    wait_for(lambda: group().get("live_workers") == 1, 30, "one live worker")
    g = group()
    assert [w["name"] for w in g["workers"]] == ["w-one"] and g["workers"][0]["alive"]
    assert g["workers"][0]["last_seen_ago_s"] < 10 and g["workers"][0]["last_seen"].endswith("+00:00")
    app = serve()
    httpx.get(app.url + "/")  # the first sample of the throughput sparkline
    started = time.monotonic()
    _charge(redis_url, namespace, *(f"t-{i}" for i in range(6)))
    done = tmp_path / "done.txt"
    wait_for(lambda: done.exists() and len(done.read_text().split()) == 6, 30, "six charges processed")
    time.sleep(max(0.0, 2.2 - (time.monotonic() - started)))
    rate = re.search(r"<title>throughput: ([0-9.]+)/s now", httpx.get(app.url + "/").text)
    assert rate and float(rate.group(1)) > 0, "no throughput shown after six messages"
    api = httpx.get(app.url + "/api/overview").json()
    groups = next(x["groups"] for x in api["destinations"] if x["name"] == "dash.charges")
    assert groups[0]["live_workers"] == 1
    _stop(proc)
    g = group()
    assert g["live_workers"] == 0  # not "consumers 1" with every worker stopped
    assert g["workers"][0]["name"] == "w-one" and not g["workers"][0]["alive"]


def test_the_overview_shows_the_outbox_backlog(serve: Any, tmp_path: Path) -> None:
    import anyio

    from framework import outbox

    url = f"sqlite:///{tmp_path / 'outbox.db'}"

    async def stage() -> None:
        engine = outbox.create_engine(url)
        await outbox.create_tables(engine)
        async with engine.begin() as conn:
            for i in range(3):
                await outbox.add_command(conn, "dash.refunds", {"order_id": f"r-{i}"})
        await engine.dispose()

    anyio.run(stage)
    html = httpx.get(serve(database_url=url).url + "/").text
    assert re.search(r'id="outbox"[^>]*><span>3 waiting \(oldest [0-9.]+ s\)</span>', html), html
    assert "0 refused" in html
    missing = httpx.get(serve().url + "/").text
    assert "no outbox database given" in missing


def test_framework_dashboard_serves_read_only_on_loopback(worker_env: dict[str, str], tmp_path: Path) -> None:
    from tests.dashboard_support import free_port

    port = free_port()
    log = open(tmp_path / "dashboard.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "framework", "dashboard", "--port", str(port)], env=worker_env, stdout=log, stderr=log
    )
    try:

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/").status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, 30, "framework dashboard to answer")
        page = httpx.get(f"http://127.0.0.1:{port}/")
        assert "read-only" in page.text and page.headers["x-frame-options"] == "DENY"
        assert httpx.get(f"http://127.0.0.1:{port}/static/htmx.min.js").status_code == 200  # vendored, no CDN
        refused = httpx.post(
            f"http://127.0.0.1:{port}/dead-letters/apply", headers={"origin": f"http://127.0.0.1:{port}"}
        )
        assert refused.status_code == 403
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
    assert "dashboard on http://127.0.0.1:" in (tmp_path / "dashboard.log").read_text()


def test_a_killed_worker_is_shown_gone_once_its_heartbeat_lapses(
    workers: Workers, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    proc = workers.start("dashapp:payments", "w-killed", FRAMEWORK_LEASE_TTL="1", DASH_DONE=str(tmp_path / "d"))
    env = {"REDIS_URL": redis_url, "FRAMEWORK_NAMESPACE": namespace}

    def workers_seen() -> list[dict[str, Any]]:
        out = run_cli("status", "dash.charges", "--json", env=env)
        groups = json.loads(out.stdout)[0]["groups"] if out.returncode == 0 else []
        return groups[0]["workers"] if groups else []

    wait_for(lambda: [w["alive"] for w in workers_seen()] == [True], 30, "the worker's first heartbeat")
    proc.kill()  # no goodbye: only the heartbeat's age tells
    proc.wait()
    wait_for(lambda: [w["alive"] for w in workers_seen()] == [False], 10, "the killed worker to show as gone")
    table = run_cli("status", "dash.charges", env={**env, "COLUMNS": "200"})
    assert re.search(r"payments\s*│\s*0\s*│", table.stdout), table.stdout  # live workers: 0


def _in_thread(fn: Any) -> Any:
    """Run an async function to completion off Playwright's loop (its sync API runs one in this thread)."""
    import concurrent.futures

    import anyio

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(anyio.run, fn).result()


def _refuse(url: str, redis_url: str, namespace: str, body: dict[str, Any]) -> str:
    """Stage an event to a name declared as a queue and let the relay refuse it; its message id."""
    from broker import connect
    from framework import Queue, outbox

    async def go() -> str:
        engine = outbox.create_engine(url)
        broker = await connect(redis_url, namespace=namespace)
        try:
            await outbox.create_tables(engine)
            await broker.declare(Queue("dash.jobs").spec())
            async with engine.begin() as conn:
                message_id = await outbox.add_event(conn, "dash.jobs", body)
            await outbox.OutboxRelay(engine, broker).drain()
            return str(message_id)
        finally:
            await broker.close()
            await engine.dispose()

    return str(_in_thread(go))


def _outbox_errors(url: str) -> dict[str, str | None]:
    from sqlalchemy import select

    from framework import outbox

    async def go() -> dict[str, str | None]:
        engine = outbox.create_engine(url)
        try:
            async with engine.connect() as conn:
                t = outbox.outbox_table
                rows = (await conn.execute(select(t.c.message_id, t.c.error))).all()
        finally:
            await engine.dispose()
        return {r.message_id: r.error for r in rows}

    return dict(_in_thread(go))


def test_a_refused_outbox_row_is_discarded_from_the_page_and_not_one_refused_after(
    browser: Any, serve: Any, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    first = _refuse(url, redis_url, namespace, {"n": 1, "token": "s3cret"})
    app = serve(actions=True, database_url=url)
    page = browser.new_page(viewport={"width": 1300, "height": 800})
    page.goto(app.url + "/")
    page.locator("nav a", has_text="Outbox").click()
    row = page.locator(f'#refused tr[data-message-id="{first}"]')
    assert "declared as a queue" in row.inner_text() and "dash.jobs" in row.inner_text()
    assert "s3cret" not in page.content() and "[redacted]" in row.inner_text()
    later = _refuse(url, redis_url, namespace, {"n": 2})  # refused after the page loaded: not ticked, not shown
    row.locator('input[name="ids"]').check()
    page.locator("#discard-selected").click()
    assert page.locator("#count").get_attribute("data-count") == "1"
    page.screenshot(path=str(SHOTS / "dashboard-outbox-confirm.png"), full_page=True)
    with structlog.testing.capture_logs() as logged:
        page.locator("#confirm").click()
        page.wait_for_selector("#notice")
    assert "1 of 1 discarded" in page.locator("#notice").inner_text()
    [entry] = [e for e in logged if e.get("action") == "outbox.discard"]  # the audit log: who and what
    assert entry["who"] == "anonymous@127.0.0.1" and entry["discarded"] == 1 and entry["ids"] == [first]
    states = _outbox_errors(url)
    assert first not in states and "declared as a queue" in (states[later] or "")

    # retry from the page: the broker would refuse it again at once, so it stays and the page says so
    page.locator(f'#refused tr[data-message-id="{later}"] button[name="retry_one"]').click()
    assert page.locator("#count").get_attribute("data-count") == "1"
    page.locator("#confirm").click()
    page.wait_for_selector("#notice")
    assert "0 of 1 put back in line; 1 stay refused" in page.locator("#notice").inner_text()
    assert _outbox_errors(url)[later] is not None

    read_only = serve(database_url=url)
    html = httpx.get(read_only.url + "/outbox").text
    assert later in html and "discard_one" not in html and "discard-selected" not in html and "retry_one" not in html
    form = {"action": "discard", "ids": later, "csrf": _csrf(html)}
    for path in ("/outbox/confirm", "/outbox/apply"):
        r = httpx.post(read_only.url + path, data=form, headers={"origin": read_only.url})
        assert r.status_code == 403 and "read-only" in r.text, (path, r.status_code, r.text)
    assert later in _outbox_errors(url)
