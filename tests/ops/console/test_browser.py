"""The console in a real headless browser (Debian's chromium via Playwright; one browser
and one daemon for the module): log in; a held message seen in the queue view and released
from the console, then the CLI agrees; a chart draws points for mail just sent; a viewer
cannot act; a wrong password is slowed. (The CSRF refusal is plain HTTP:
tests/ops/console/test_routes.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from relay.ops.console import auth
from tests.console_browser import LAUNCH_ARGS, chromium_path, why_unavailable
from tests.harness import RelayProcess, free_port, make_message, send

_why = why_unavailable()
if _why is not None:
    print(f"\ntest_console_browser: skipped: {_why}")
pytestmark = pytest.mark.skipif(_why is not None, reason=_why or "")

USERS = {"olga": ("operator", "operator-pw"), "vic": ("viewer", "viewer-pw")}


@pytest.fixture(scope="module")
def relay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RelayProcess]:
    work = tmp_path_factory.mktemp("console-browser")
    (work / "users").write_text(
        "".join(auth.user_line(n, r, p) + "\n" for n, (r, p) in USERS.items())
    )
    r = RelayProcess(
        work,
        {
            "admin": {"users_file": "users"},
            "upstream": {
                "mode": "smarthost",
                "smarthost": {"host": "127.0.0.1", "port": free_port(), "tls": "none"},
            },
        },
    )
    r.start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path(), args=LAUNCH_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _login(browser: Any, relay: RelayProcess, name: str) -> Any:
    ctx = browser.new_context()
    page = ctx.new_page()
    base = f"http://127.0.0.1:{relay.admin_port}"
    page.goto(f"{base}/console/")
    assert page.url.endswith("/console/login")
    page.fill("input[name=name]", name)
    page.fill("input[name=password]", USERS[name][1])
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/console/")
    return page


def test_release_a_held_message_and_the_chart(relay: RelayProcess, browser: Any) -> None:
    send(relay.port, "app@example.com", ["held@example.org"], make_message(1))
    qid = relay.queue()[0]["id"]
    relay.cli("queue", "hold", qid, check=True)
    # a hold that meets the recipient in its first attempt (`sending`) marks it, and the
    # attempt's end (the upstream is down: a deferral) makes it held (relay/spool/model.py)
    relay.wait_until(
        lambda: {m["id"]: m["state"] for m in relay.queue()}[qid] == "held",
        timeout=15,
        what="the message held",
    )
    page = _login(browser, relay, "olga")
    # the chart of the last hour draws the mail just accepted (the current minute is
    # read from the daemon's counters); the overview refreshes itself without a reload
    sel = 'polyline[data-series="accepted"]'
    page.wait_for_selector(sel)
    assert float(page.locator(sel).first.get_attribute("data-max")) >= 1
    send(relay.port, "app@example.com", ["later@example.org"], make_message(2))
    # (no wait_for_function: the page's CSP forbids evaluating strings, Playwright's too)
    page.wait_for_selector("#live[data-updated]", state="attached", timeout=15000)
    deadline = time.monotonic() + 15
    # the sum, not the top: the two messages may fall in two minutes (a flake of CI's, when
    # the second crossed a minute boundary: each minute's point was 1)
    while float(page.locator(sel).first.get_attribute("data-sum")) < 2:
        assert time.monotonic() < deadline, "the overview did not refresh the chart"
        page.wait_for_timeout(500)
    # the queue view shows the held message; release it from the console
    page.click("nav >> text=Queue")
    page.select_option("select[name=state]", "held")
    page.click("form.filters button[type=submit]")
    row = page.locator("tr", has_text=qid)
    assert row.count() == 1
    row.locator("input[name=id]").check()
    page.click("button[name=action][value=release]")
    assert page.locator("#dry-run-count").inner_text() == "1"
    page.click("form[action='/console/queue/act'] button[type=submit]")
    assert page.locator("#action-count").inner_text() == "1"
    state = {m["id"]: m["state"] for m in relay.queue()}[qid]
    assert state != "held"  # the CLI agrees

    def released() -> bool:  # the daemon's log line may reach its file a moment later
        acts = [e for e in relay.events() if e.get("event") == "operator_action"]
        return bool(acts) and acts[-1]["msg"] == "release" and acts[-1]["user"] == "olga"

    relay.wait_until(released, timeout=10, what="the release logged as olga's action")
    page.context.close()


def test_viewer_cannot_act(relay: RelayProcess, browser: Any) -> None:
    send(relay.port, "app@example.com", ["v@example.org"], make_message(3))
    page = _login(browser, relay, "vic")
    page.click("nav >> text=Queue")
    assert page.locator("button[name=action]").count() == 0
    token = page.locator("input[name=csrf]").first.get_attribute("value")
    base = f"http://127.0.0.1:{relay.admin_port}"
    held = [m["id"] for m in relay.queue() if m["state"] == "held"]
    resp = page.request.post(
        f"{base}/console/queue/act", form={"action": "hold", "scope": "all", "csrf": token}
    )
    assert resp.status == 403
    assert [m["id"] for m in relay.queue() if m["state"] == "held"] == held
    assert any(m["state"] != "held" for m in relay.queue())  # there was something to hold
    page.context.close()


def test_wrong_password_is_slowed(relay: RelayProcess, browser: Any) -> None:
    ctx = browser.new_context()
    page = ctx.new_page()
    page.goto(f"http://127.0.0.1:{relay.admin_port}/console/login")
    page.fill("input[name=name]", "olga")
    page.fill("input[name=password]", "wrong")
    t0 = time.monotonic()
    page.click("button[type=submit]")
    page.wait_for_selector("text=wrong name or password")
    assert time.monotonic() - t0 >= 0.9
    ctx.close()
