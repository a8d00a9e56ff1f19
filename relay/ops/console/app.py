"""The operator console: pages under /console on the admin listener (README "Console").

Rules:
- It is handed what it shows (the spool writer, the metrics, the health model's document,
  the spool folder), never the daemon. Every read runs beside the writer (`writer.read`),
  every change is one writer job that also writes the audit row (`ops.log_operator`, as the
  CLI's `_act`) and logs an `operator_action` line with the user's name.
- Access (relay/ops/console/auth.py): with `admin.users_file`, a signed session cookie
  from the login form; without one (only allowed on a loopback listener, relay/config/tree.py),
  anyone who reaches the listener reads as a `viewer` and nobody acts. Every POST needs the
  session's CSRF token (else 403); actions need the `operator` role (else 403).
- A wrong password waits LOGIN_FAIL_DELAY (doubling per failure from the same address,
  at most 8 s, asyncio.sleep: the loop goes on), is counted in
  `relay_console_login_failures_total`, and 10 within 10 minutes ban the address from the
  login for 10 minutes (relay/inbound/anvil.py's AUTH failure table; `relay_console_login_bans`).
- Pages are hand-written HTML (relay/ops/console/html.py escapes everything printed) with
  a Content-Security-Policy allowing only this origin's one script and one stylesheet.
- Bulk actions: the confirmation page counts the selection with the same function the
  action then runs (in one writer job), so the number shown is the number acted on unless
  the queue changed in between; the result page says both.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import Counter

from relay.delivery.lanes import LANE_PRIORITY
from relay.inbound import anvil
from relay.ops import alerts as alerts_mod
from relay.ops.console import auth, rollup
from relay.ops.console.html import (
    Raw,
    chart,
    h,
    hidden,
    link,
    login_page,
    page,
    post_form,
    status,
    table,
    url,
)
from relay.ops.console.html import static as static_file
from relay.ops.http import HttpServer, Request, Response
from relay.ops.logs import log_event
from relay.ops.metrics import Metrics
from relay.spool import bodies, ops
from relay.spool.writer import SpoolWriter

log = logging.getLogger(__name__)

LOGIN_FAIL_DELAY = 1.0
PAGE = 50
REFRESH_SECONDS = 5
OVERVIEW_CACHE = 4.0
MAX_REVOKED = 10_000
SHOWN = 500  # suppressions on one page
REASONS_SAMPLE = 10_000  # deferral reasons: of the newest deferred recipients only
ROLLUP_EVERY = 60.0
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
ACTIONS = ("hold", "release", "retry", "delete")
STATES = ("queued", "deferred", "sending", "held", "sent", "failed")
UNFINISHED = ("pending", "deferred", "held", "sending")
ANONYMOUS = auth.Session("local", "viewer", "anonymous", float("inf"))


class Refused(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


@dataclass(frozen=True, slots=True)
class Filters:
    """The queue page's search: the CLI's filters (`queue list`, `queue find`)."""

    recipient: str = ""
    sender: str = ""
    message_id: str = ""
    queue_id: str = ""
    upstream_id: str = ""
    state: str = ""
    destination: str = ""
    older_than: str = ""

    @staticmethod
    def of(form: dict[str, list[str]]) -> Filters:
        def one(k: str) -> str:
            return (form.get(k) or [""])[0].strip()[:320]

        f = Filters(*(one(k) for k in Filters.__slots__))
        if f.state and f.state not in STATES:
            raise Refused(400, f"unknown state {f.state!r}")
        return f

    def query(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in Filters.__slots__ if getattr(self, k)}

    def kwargs(self, now: float, action: str | None = None) -> dict[str, Any]:
        from relay.config.tree import ConfigError, parse_duration
        from relay.spool.dedup import normalize_message_id

        try:
            older = parse_duration(self.older_than, "age") if self.older_than else None
        except ConfigError as e:
            raise Refused(400, str(e)) from None
        return {
            "state": self.state or None,
            "include_finished": action == "delete"
            or bool(self.message_id or self.queue_id or self.upstream_id),
            "recipient": self.recipient or None,
            "sender": self.sender or None,
            "message_id": normalize_message_id(self.message_id) if self.message_id else None,
            "queue_id": self.queue_id or None,
            "upstream_id": self.upstream_id.strip("<>") or None,
            "domain": self.destination or None,
            "older_than": older,
            "now": now,
        }


def run_bulk(
    conn: sqlite3.Connection,
    f: Filters,
    ids: list[str],
    every: bool,
    action: str,
    now: float,
    *,
    dry_run: bool,
) -> ops.BulkResult:
    """One queue action as the CLI's `queue <action> --all`/IDs runs it: the messages the
    filters select (or the chosen ids that exist), then `ops.bulk` over their recipients,
    where the recipient and destination filters select recipients (never the other
    recipients of the same message). The confirmation page runs it dry (the same WHERE as a
    SELECT), the action for real in its own job: the counts are the same unless the queue
    changed in between."""
    if every:
        target = [m["id"] for m in ops.iter_messages(conn, **f.kwargs(now, action))]
    else:
        target = ops.existing_ids(conn, ids[:1000])
    return ops.bulk(
        conn,
        action,
        target,
        now,
        recipient=(f.recipient or None) if every else None,
        domain=(f.destination or None) if every else None,
        dry_run=dry_run,
    )


def _form(text: str, most: int) -> dict[str, list[str]]:
    """A form or query string; more fields than `most` is a bad request, not a 500."""
    try:
        return parse_qs(text, max_num_fields=most)
    except ValueError:
        raise Refused(400, f"more than {most} form fields") from None


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def _in_attempt(action: str, n: int, dry: bool) -> str:
    """A hold's recipients in their attempt now: held when it ends undelivered (a release
    takes that off): relay/spool/model.py. Said apart from the recipients changed."""
    if not n or action not in ("hold", "release"):
        return ""
    will = ("would be" if dry else "will be") if action == "hold" else ("would" if dry else "will")
    end = "held when it ends, unless it delivers" if action == "hold" else "no longer be held"
    return f'; <span id="after-attempt">{n}</span> recipient{_s(n)} in an attempt now {will} {end}'


def _danger(action: str) -> str:
    return ' class="danger"' if action == "delete" else ""


class Console:
    def __init__(
        self,
        writer: SpoolWriter,
        metrics: Metrics,
        health_doc: Callable[[], dict[str, Any]],
        spool_dir: Path,
        users_file: Path | None = None,
        *,
        secure: bool = False,
        fail_delay: float = LOGIN_FAIL_DELAY,
    ) -> None:
        self.writer = writer
        self.metrics = metrics
        self.health_doc = health_doc
        self.spool_dir = spool_dir
        self.users = auth.load_users(users_file) if users_file is not None else None
        self.key = auth.load_key(spool_dir)
        self.secure = secure
        self.failures = anvil.AuthFailures(
            anvil.AuthPolicy(
                failure_delay=fail_delay,
                max_failure_delay=8.0,
                max_failures=10,
                window=600.0,
                ban_time=600.0,
            )
        )
        self.login_failures = Counter(
            "relay_console_login_failures",
            "Console logins with a wrong name or password",
            registry=metrics.registry,
        )
        self.login_bans = Counter(
            "relay_console_login_bans",
            "Client addresses banned from the console login",
            registry=metrics.registry,
        )
        self._prev: rollup.Sample | None = None
        self._overview_cache: tuple[float, dict[str, Any]] | None = None
        self._revoked: dict[str, float] = {}  # session id -> expiry: logged out
        self._task: asyncio.Task[None] | None = None

    def install(self, server: HttpServer) -> None:
        server.route("/console", self.handle)
        server.route("/console/", self.handle, prefix=True)

    # --- the per-minute series --------------------------------------------------------------

    def start(self) -> None:
        self._prev = rollup.sample(self.metrics)
        self._task = asyncio.get_running_loop().create_task(self._rollup_loop(), name="console")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _rollup_loop(self) -> None:
        while True:
            now = time.time()
            await asyncio.sleep(ROLLUP_EVERY - now % ROLLUP_EVERY + 0.05)  # just past :00
            try:
                await self.rollup_once(time.time())
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log_event(log, logging.ERROR, "console_rollup_failed", "minute not kept", exc=e)

    async def rollup_once(self, now: float) -> rollup.Minute:
        """The minute that just ended, written: its counts since the last sample."""
        cur = rollup.sample(self.metrics)
        by_state, _age = await self.writer.read(lambda c: ops.queue_gauges(c, now))
        depth = sum(by_state.get(s, 0) for s in UNFINISHED)
        m = rollup.delta(self._prev, cur, int(now // 60) - 1, depth)
        await self.writer.run(lambda c: rollup.write_minute(c, m), lazy=True)
        self._prev = cur
        return m

    # --- requests -----------------------------------------------------------------------------

    async def handle(self, req: Request) -> Response:
        try:
            return await self._handle(req)
        except Refused as e:
            return self._html(
                e.status,
                page("Refused", f'<p class="banner error">{h(e.text)}</p>', current="", who=""),
            )

    async def _handle(self, req: Request) -> Response:
        tail = req.path[len("/console") :].lstrip("/")
        if tail.startswith("static/"):
            data = static_file(tail[len("static/") :])
            if data is None or req.method not in ("GET", "HEAD"):
                return Response.text(404, "not found")
            ctype = "text/css" if tail.endswith(".css") else "text/javascript"
            return Response(200, data, f"{ctype}; charset=utf-8", dict(_SECURITY_HEADERS))
        if req.method not in ("GET", "HEAD", "POST"):
            return Response.text(405, "method not allowed")
        if tail == "login":
            return await self._login(req)
        session = self._session(req)
        if session is None:
            if req.method == "POST":
                raise Refused(403, "not logged in")
            return Response(303, b"", headers={"Location": "/console/login"})
        if req.method == "POST":
            form = _form((await req.read()).decode("utf-8", "replace"), 2000)
            token = (form.get("csrf") or [""])[0] or None
            if not auth.csrf_ok(self.key, session, token):
                log_event(
                    log,
                    logging.WARNING,
                    "console_csrf",
                    "console POST without a valid token",
                    peer=req.peer,
                    path=tail,
                )
                raise Refused(403, "missing or wrong CSRF token: reload the page and try again")
            if tail == "logout":
                # the cookie is dropped by the browser and its session refused here from
                # now on (until a restart; it expires within SESSION_TTL anyway)
                now = time.time()
                self._revoked = {k: v for k, v in self._revoked.items() if v > now}
                if len(self._revoked) < MAX_REVOKED:
                    self._revoked[session.sid] = session.expires
                log_event(log, logging.INFO, "console_logout", "console logout", user=session.user)
                return Response(
                    303,
                    b"",
                    headers={
                        "Location": "/console/login",
                        "Set-Cookie": auth.cookie_header("", secure=self.secure, max_age=0),
                    },
                )
            if not session.can_act:
                raise Refused(403, f"{session.user} is a {session.role}: only operators act")
            return await self._post(tail, form, session)
        query = _form(req.query, 100)
        return await self._get(tail, query, session)

    def _session(self, req: Request) -> auth.Session | None:
        if self.users is None:  # an operator's cookie from before the users file went: no
            return ANONYMOUS
        value = auth.parse_cookies(req.headers.get("cookie", "")).get(auth.COOKIE)
        if value:
            s = auth.verify_session(self.key, value, time.time())
            if (
                s is not None
                and s.sid not in self._revoked
                and (u := self.users.get(s.user)) is not None
                and u.role == s.role
            ):
                return s
        return None

    async def _login(self, req: Request) -> Response:
        if self.users is None:
            return Response(303, b"", headers={"Location": "/console/"})
        if req.method != "POST":
            return self._html(200, login_page())
        now = time.time()
        ip = anvil.client_key(req.peer)
        if self.failures.banned_until(ip, now) is not None:
            return self._html(429, login_page("too many failed logins from your address: wait"))
        form = _form((await req.read()).decode("utf-8", "replace"), 10)
        name = (form.get("name") or [""])[0][:64]
        password = (form.get("password") or [""])[0][:1024]
        user = await asyncio.to_thread(auth.check_login, self.users, name, password)
        if user is None:
            verdict = self.failures.failure(ip, now)
            self.login_failures.inc()
            if verdict.banned_until is not None:
                self.login_bans.inc()
            log_event(
                log,
                logging.WARNING,
                "console_login_failed",
                "console login refused",
                peer=req.peer,
                failures=verdict.failures,
                banned=verdict.banned_until is not None,
            )
            await asyncio.sleep(verdict.delay)  # slowed, off the loop's critical path
            return self._html(401, login_page("wrong name or password"))
        s = auth.new_session(user.name, user.role, now)
        log_event(
            log,
            logging.INFO,
            "console_login",
            "console login",
            user=user.name,
            role=user.role,
            peer=req.peer,
        )
        return Response(
            303,
            b"",
            headers={
                "Location": "/console/",
                "Set-Cookie": auth.cookie_header(
                    auth.sign_session(self.key, s),
                    secure=self.secure,
                    max_age=int(auth.SESSION_TTL),
                ),
            },
        )

    def _html(self, status_: int, body: bytes) -> Response:
        return Response(status_, body, "text/html; charset=utf-8", dict(_SECURITY_HEADERS))

    def _who(self, s: auth.Session) -> str:
        if s is ANONYMOUS:
            return '<span title="no admin.users_file: read-only">local viewer (read-only)</span>'
        return f"<span>{h(s.user)} ({h(s.role)})</span>" + post_form(
            "/console/logout", auth.csrf_token(self.key, s), {}, "Log out", "plain"
        )

    def _page(
        self, s: auth.Session, title: str, body: str, current: str, refresh: int = 0
    ) -> Response:
        return self._html(
            200, page(title, body, current=current, who=self._who(s), refresh=refresh)
        )

    async def _get(self, tail: str, q: dict[str, list[str]], s: auth.Session) -> Response:
        if tail == "":
            return self._page(s, "Overview", await self._overview_body(), "", REFRESH_SECONDS)
        if tail == "overview.json":
            import json

            body = json.dumps(
                {"html": await self._overview_live(), "updated": ops.iso_utc(time.time())}
            ).encode()
            return Response(200, body, "application/json", dict(_SECURITY_HEADERS))
        if tail == "queue":
            return self._page(s, "Queue", await self._queue_body(q, s), "queue")
        if tail.startswith("message/"):
            return self._page(s, "Message", await self._message_body(tail[8:], s), "queue")
        if tail == "destinations":
            return self._page(s, "Destinations", await self._destinations_body(s), "destinations")
        if tail == "suppressions":
            return self._page(
                s, "Suppressions", await self._suppressions_body(q, s), "suppressions"
            )
        if tail == "suppressions.csv":
            rows = await self.writer.read(ops.suppression_list)
            buf = io.StringIO()
            w = csv.writer(buf)
            w.writerow(["address", "scope", "reason", "created_at", "source"])
            for r in rows:
                w.writerow(
                    [
                        r["address"],
                        r["scope"],
                        r["reason"],
                        ops.iso_utc(r["created_at"]),
                        r["source"],
                    ]
                )
            return Response(
                200,
                buf.getvalue().encode(),
                "text/csv; charset=utf-8",
                {
                    **_SECURITY_HEADERS,
                    "Content-Disposition": 'attachment; filename="suppressions.csv"',
                },
            )
        if tail == "dead":
            return self._page(s, "Dead letters", await self._dead_body(q), "dead")
        if tail == "alerts":
            return self._page(s, "Alerts", await self._alerts_body(), "alerts")
        if tail == "feedback":
            return self._page(s, "Feedback events", await self._feedback_body(), "feedback")
        return Response.text(404, "not found")

    async def _post(self, tail: str, form: dict[str, list[str]], s: auth.Session) -> Response:
        if tail == "queue/confirm":
            return self._page(s, "Confirm", await self._queue_confirm(form, s), "queue")
        if tail == "queue/act":
            return self._page(s, "Done", await self._queue_act(form, s), "queue")
        if tail == "destinations/act":
            return self._page(s, "Done", await self._destination_act(form, s), "destinations")
        if tail == "suppressions/act":
            return self._page(s, "Done", await self._suppression_act(form, s), "suppressions")
        return Response.text(404, "not found")

    async def _act(
        self,
        s: auth.Session,
        action: str,
        detail: dict[str, Any],
        fn: Callable[[sqlite3.Connection], Any],
    ) -> Any:
        """One change and its audit row in one writer job, logged as the CLI's are."""
        now = time.time()
        detail = {**detail, "user": s.user, "via": "console"}

        def job(c: sqlite3.Connection) -> Any:
            res = fn(c)
            n = res[0] if isinstance(res, tuple) else res
            ops.log_operator(
                c, action, {**detail, "result": n if isinstance(n, int) else None}, now
            )
            return res

        res = await self.writer.run(job)
        self._overview_cache = None  # the next overview shows the change
        log_event(log, logging.INFO, "operator_action", action, **detail)
        return res

    # --- overview -----------------------------------------------------------------------------

    async def _overview_body(self) -> str:
        return (
            f'<div id="live" data-src="/console/overview.json">{await self._overview_live()}</div>'
        )

    async def _overview_live(self) -> str:
        now = time.time()
        doc = self.health_doc()
        minute = int(now // 60)

        d = await self._overview_data(now, minute)
        checks = table(
            ["check", "status", "since", "detail"],
            [
                [
                    h(c["name"]),
                    status(c["status"]),
                    h(str(c["since"]).replace("T", " ")),
                    h(c["detail"]),
                ]
                for c in doc.get("checks", [])
            ],
        )
        st = d["states"]
        queue = table(
            ["queued", "deferred", "held", "sending"],
            [
                [
                    f'<span data-state="pending">{st.get("pending", 0)}</span>',
                    f'<span data-state="deferred">{st.get("deferred", 0)}</span>',
                    f'<span data-state="held">{st.get("held", 0)}</span>',
                    f'<span data-state="sending">{st.get("sending", 0)}</span>',
                ]
            ],
            num=range(4),
        ) + table(
            ["lane", "waiting (queued + deferred)", "dead (last hour)"],
            [
                [h(lane), str(v.get("waiting", 0)), str(v.get("dead_last_hour", 0))]
                for lane, v in sorted(d["lanes"].items())
            ],
            num=[1, 2],
        )
        top = sorted(d["dests"].items(), key=lambda kv: -kv[1])[:8]
        dests = table(["destination", "waiting"], [[h(k), str(v)] for k, v in top], num=[1])
        reasons = table(
            ["deferral reason (latest 10,000 deferred)", "recipients"],
            [[h(str(r)[:160]), str(n)] for r, n in d["reasons"]],
            num=[1],
        )
        # the minute so far, from the counters in memory: mail sent a moment ago is drawn
        if self._prev is not None:
            depth = sum(d["states"].values())
            cur = rollup.delta(self._prev, rollup.sample(self.metrics), minute, depth)
            d["series"].append(rollup.as_row(cur))
        charts = self._charts(d["series"], minute)
        overall = status(str(doc.get("status", "?")))
        return (
            f'<p>Health: {overall} <span class="muted">updated {h(ops.iso_utc(now))}</span></p>'
            f'<div class="grid"><div class="card wide"><h2>Health checks</h2>{checks}</div>'
            f'<div class="card"><h2>Queue now (recipients)</h2>{queue}</div>'
            f'<div class="card"><h2>Top destinations</h2>{dests}</div>'
            f'<div class="card"><h2>Deferral reasons</h2>{reasons}</div></div>'
            f"{charts}"
        )

    async def _overview_data(self, now: float, minute: int) -> dict[str, Any]:
        """The overview's spool reads, shared for OVERVIEW_CACHE seconds (several open tabs
        refreshing every 5 s cost one read). Counted on the recipients' own columns and
        indexes (lane_prio, state): no join with messages over a deep queue."""
        cached = self._overview_cache
        if cached is not None and now - cached[0] < OVERVIEW_CACHE:
            return {**cached[1], "series": list(cached[1]["series"])}
        lane_of = {v: k for k, v in LANE_PRIORITY.items()}

        def read(c: sqlite3.Connection) -> dict[str, Any]:
            # waiting per lane from the due index (it holds the lane: no row is read);
            # the states from the state index; the recent dead by lane (few rows)
            lanes: dict[str, dict[str, int]] = {}
            for prio, n in c.execute(
                "SELECT lane_prio, count(*) FROM recipients INDEXED BY recipients_due"
                " WHERE state IN ('pending', 'deferred') GROUP BY lane_prio"
            ):
                lanes.setdefault(lane_of.get(prio, str(prio)), {})["waiting"] = n
            for prio, n in c.execute(
                "SELECT lane_prio, count(*) FROM recipients"
                " WHERE state IN ('bounced', 'failed') AND updated_at >= ? GROUP BY lane_prio",
                (now - 3600,),
            ):
                lanes.setdefault(lane_of.get(prio, str(prio)), {})["dead_last_hour"] = n
            states = {
                s: n
                for s, n in c.execute(
                    "SELECT state, count(*) FROM recipients"
                    " WHERE state IN ('pending', 'deferred', 'held', 'sending') GROUP BY state"
                )
            }
            reasons = c.execute(
                "SELECT coalesce(last_reply, reason, '(none)'), count(*) FROM"
                " (SELECT last_reply, reason FROM recipients WHERE state = 'deferred'"
                f" ORDER BY id DESC LIMIT {REASONS_SAMPLE}) AS latest"
                " GROUP BY 1 ORDER BY 2 DESC LIMIT 8"
            ).fetchall()
            return {
                "lanes": lanes,
                "states": states,
                "dests": ops.waiting_per_destination(c),
                "reasons": reasons,
                "series": rollup.read_series(c, minute - 24 * 60),
            }

        d = await self.writer.read(read)
        self._overview_cache = (now, d)
        return {**d, "series": list(d["series"])}

    def _charts(self, rows: list[dict[str, Any]], minute: int) -> str:
        by = {r["minute"]: r for r in rows}
        out = []
        for label, span, step in (("last hour", 60, 1), ("last 24 hours", 24 * 60, 10)):
            xs = list(range(minute - span + 1, minute + 1, step))
            buckets = [[by[m] for m in range(x, x + step) if m in by] for x in xs]
            flows = {
                k: [float(sum(r[k] for r in b)) / step for b in buckets] for k in rollup.SERIES
            }
            depth = {"queue depth": [float(b[-1]["queue_depth"]) if b else None for b in buckets]}
            lat = {
                p: [max((r[p] for r in b if r[p] is not None), default=None) for b in buckets]
                for p in ("p50", "p90", "p99")
            }
            out.append(chart(f"Per minute, {label}", xs, flows, unit="recipients/min"))
            out.append(chart(f"Queue depth, {label}", xs, depth, unit="recipients"))
            out.append(chart(f"Delivery latency, {label}", xs, lat, unit="s"))
        return f'<h2>Traffic</h2><div class="grid charts">{"".join(out)}</div>'

    # --- queue --------------------------------------------------------------------------------

    async def _queue_body(self, q: dict[str, list[str]], s: auth.Session) -> str:
        f = Filters.of(q)
        after = (q.get("after") or [""])[0] or None
        now = time.time()
        kw = f.kwargs(now)

        def read(c: sqlite3.Connection) -> list[dict[str, Any]]:
            return list(ops.iter_messages(c, **kw, after=after, limit=PAGE + 1, page=PAGE + 1))

        msgs = await self.writer.read(read)
        more = len(msgs) > PAGE
        msgs = msgs[:PAGE]
        fields = [
            ("recipient", "Recipient"),
            ("sender", "Sender"),
            ("message_id", "Message-ID"),
            ("queue_id", "Queue id"),
            ("upstream_id", "Upstream id"),
            ("destination", "Destination"),
            ("older_than", "Older than (e.g. 1h)"),
        ]
        inputs = "".join(
            f'<label>{h(t)}<input name="{k}" value="{h(getattr(f, k))}"></label>' for k, t in fields
        )
        opts = "".join(
            f'<option value="{v}"{" selected" if f.state == v else ""}>{v or "unfinished"}</option>'
            for v in ("", *STATES)
        )
        search = (
            f'<form class="filters" method="get" action="/console/queue">{inputs}'
            f'<label>State<select name="state">{opts}</select></label>'
            f'<button type="submit">Search</button></form>'
        )
        rows = []
        for m in msgs:
            rc = m["recipients"]
            who = ", ".join(r["address"] for r in rc[:3]) + (
                f" +{len(rc) - 3}" if len(rc) > 3 else ""
            )
            last = next((r["last_reply"] for r in rc if r["last_reply"]), "")
            box = (
                f'<input type="checkbox" name="id" value="{h(m["id"])}" '
                f'aria-label="select {h(m["id"])}">'
            )
            rows.append(
                [
                    box,
                    link(url(f"message/{m['id']}"), m["id"]),
                    h(m["state"]),
                    h(m["created_at"]),
                    h(m["sender"] or "<>"),
                    h(who),
                    h(", ".join(sorted({r["destination"] for r in rc}))),
                    str(m["attempts"]),
                    h(str(last)[:120]),
                ]
            )
        listing = table(
            [
                Raw('<input type="checkbox" id="select-all" aria-label="select all">'),
                "queue id",
                "state",
                "arrived",
                "sender",
                "recipients",
                "destination",
                "tries",
                "last reply",
            ],
            rows,
            num=[7],
        )
        pager = ""
        if more:
            nxt = link(url("queue", **f.query(), after=msgs[-1]["id"]), "Next page →")
            pager = f'<p class="pager">{nxt}</p>'
        acts = ""
        if s.can_act:
            csrf = auth.csrf_token(self.key, s)
            keep = "".join(hidden(k, v) for k, v in f.query().items())
            buttons = "".join(
                f'<button type="submit" name="action" value="{a}"{_danger(a)}>'
                f"{a.capitalize()}</button>"
                for a in ACTIONS
            )
            acts = (
                f'<div class="actions"><label><input type="radio" name="scope" value="selected"'
                f' checked> the selected messages</label><label><input type="radio" name="scope"'
                f' value="all"> all messages matching the search</label>{buttons}</div>'
            )
            return (
                f'{search}<form method="post" action="/console/queue/confirm">'
                f"{hidden('csrf', csrf)}{keep}{acts}{listing}</form>{pager}"
            )
        return f"{search}{listing}{pager}"

    def _selection(self, form: dict[str, list[str]]) -> tuple[str, Filters, list[str], bool]:
        action = (form.get("action") or [""])[0]
        if action not in ACTIONS:
            raise Refused(400, f"unknown action {action!r}")
        every = (form.get("scope") or ["selected"])[0] == "all"
        ids = [i for i in form.get("id", []) if i][:1000]
        if not every and not ids:
            raise Refused(400, "select messages first, or choose all messages matching")
        return action, Filters.of(form), ids, every

    async def _queue_confirm(self, form: dict[str, list[str]], s: auth.Session) -> str:
        action, f, ids, every = self._selection(form)
        now = time.time()
        res = await self.writer.read(
            lambda c: run_bulk(c, f, ids, every, action, now, dry_run=True)
        )
        n, r = len(res.messages), res.recipients
        what = (
            "all messages matching "
            + h(
                ", ".join(f"{k}={v}" for k, v in f.query().items())
                or "(no filter: every unfinished message)"
            )
            if every
            else "the selected messages"
        )
        fields: dict[str, Any] = {
            "action": action,
            "scope": "all" if every else "selected",
            "expect": f"{n}/{r}",
            **f.query(),
        }
        inner = "".join(hidden("id", i) for i in ([] if every else ids))
        csrf = auth.csrf_token(self.key, s)
        gone = (
            f", removing {res.removed} message{_s(res.removed)} whole" if action == "delete" else ""
        )
        gone += _in_attempt(action, res.after_attempt, dry=True)
        return (
            f'<p class="banner">{h(action.capitalize())}: <strong id="dry-run-count">{n}</strong>'
            f' message{_s(n)} (<span id="dry-run-recipients">{r}</span> recipient{_s(r)}'
            f"{gone}) of {what}.</p>"
            f'<form method="post" action="/console/queue/act">{hidden("csrf", csrf)}'
            + "".join(hidden(k, v) for k, v in fields.items())
            + f'{inner}<div class="actions"><button type="submit"{_danger(action)}>'
            + f"{h(action.capitalize())} {r} recipient{_s(r)}</button> "
            + link(url("queue", **f.query()), "Cancel")
            + "</div></form>"
        )

    async def _queue_act(self, form: dict[str, list[str]], s: auth.Session) -> str:
        action, f, ids, every = self._selection(form)
        now = time.time()
        expect = (form.get("expect") or [""])[0]

        def fn(c: sqlite3.Connection) -> tuple[int, ops.BulkResult]:
            res = run_bulk(c, f, ids, every, action, now, dry_run=False)
            return res.recipients, res

        detail = {"ids": ids[:100], "all": every, "filters": f.query()}
        _n, res = await self._act(s, action, detail, fn)
        if res.paths:
            await asyncio.to_thread(bodies.delete_bodies, self.spool_dir, list(res.paths))
        n, r = len(res.messages), res.recipients
        note = ""
        if expect and expect != f"{n}/{r}":
            note = (
                f" (the confirmation counted {h(expect.replace('/', ' messages, '))}"
                " recipients: the queue changed in between)"
            )
        gone = f"; {res.removed} message{_s(res.removed)} removed whole" if res.removed else ""
        gone += _in_attempt(action, res.after_attempt, dry=False)
        return (
            f'<p class="banner">{h(action)}: <strong id="action-count">{n}</strong>'
            f' message{_s(n)}, <span id="action-recipients">{r}</span> recipient{_s(r)}'
            f" changed{gone}{note}.</p>"
            f"<p>{link(url('queue', **f.query()), 'Back to the queue')}</p>"
        )

    # --- a message ----------------------------------------------------------------------------

    async def _message_body(self, qid: str, s: auth.Session) -> str:
        def read(c: sqlite3.Connection) -> tuple[dict[str, Any] | None, bytes, list[Any]]:
            msg = ops.show_message(c, qid)
            if msg is None:
                return None, b"", []
            raw, path = ops.message_body(c, qid)
            try:
                data = bodies.load(self.spool_dir, raw, path)
            except OSError:
                data = b""
            fb = c.execute(
                "SELECT at, provider, type, recipient, outcome, reason FROM feedback_events"
                " WHERE msg_id = ? ORDER BY at",
                (qid,),
            ).fetchall()
            return msg, data, fb

        msg, data, fb = await self.writer.read(read)
        if msg is None:
            raise Refused(404, f"no such message: {qid}")
        head, _sep, body = data.partition(b"\r\n\r\n")
        events: list[tuple[str, str, str, str, str]] = [
            (
                msg["created_at"],
                "accepted",
                "",
                f"from {msg['sender'] or '<>'} ({msg['size']} bytes, lane {msg['lane']})",
                "",
            )
        ]
        for a in msg["attempt_log"]:
            dur = "" if a["duration"] is None else f"{a['duration']:.2f} s"
            events.append(
                (
                    a["at"],
                    f"attempt: {a['outcome']}",
                    a["host"] or a["destination"],
                    f"{a['recipient'] or ''}: {a['reply'] or ''}",
                    dur,
                )
            )
        for at, provider, typ, rcpt, outcome, reason in fb:
            events.append(
                (
                    ops.iso_utc(at),
                    f"feedback: {typ}",
                    provider,
                    f"{rcpt}: {outcome} {reason or ''}",
                    "",
                )
            )
        timeline = table(
            ["time", "event", "host", "detail", "duration"], [[h(x) for x in e] for e in events]
        )
        rcpts = table(
            ["recipient", "state", "tries", "destination", "next attempt", "last reply"],
            [
                [
                    h(r["address"]),
                    # held during its attempt: held when it ends undelivered (relay/spool/model.py)
                    h(
                        r["state"]
                        + (", held after this attempt" if r.get("hold_after_attempt") else "")
                    ),
                    str(r["attempts"]),
                    h(r["destination"]),
                    h(r["next_attempt_at"] or ""),
                    h(r["last_reply"] or r["reason"] or ""),
                ]
                for r in msg["recipients"]
            ],
            num=[2],
        )
        summary = table(
            ["field", "value"],
            [
                [h(k), h(msg.get(k))]
                for k in (
                    "id",
                    "state",
                    "message_id",
                    "sender",
                    "size",
                    "created_at",
                    "lane",
                    "client",
                    "peer",
                    "identity",
                )
            ],
        )
        acts = ""
        if s.can_act:
            csrf = auth.csrf_token(self.key, s)
            acts = (
                '<div class="actions">'
                + "".join(
                    post_form(
                        "/console/queue/confirm",
                        csrf,
                        {"action": a, "id": qid},
                        a.capitalize(),
                        "danger" if a == "delete" else "",
                    )
                    for a in ACTIONS
                )
                + "</div>"
            )
        body_html = (
            f"<h2>Body</h2><pre>{h(body.decode('utf-8', 'replace')[:200_000])}</pre>"
            if s.can_act
            else '<p class="muted">The body is shown to operators only.</p>'
        )
        return (
            f'{acts}<div class="grid"><div class="card"><h2>Message</h2>{summary}</div>'
            f'<div class="card"><h2>Recipients</h2>{rcpts}</div></div>'
            f"<h2>Timeline</h2>{timeline}"
            f"<h2>Headers</h2><pre>{h(head.decode('utf-8', 'replace'))}</pre>{body_html}"
        )

    # --- destinations -------------------------------------------------------------------------

    async def _destinations_body(self, s: auth.Session) -> str:
        now = time.time()

        def read(c: sqlite3.Connection) -> tuple[Any, Any, Any]:
            rt = ops.get_runtime(c, "daemon")
            return (rt[0] if rt else {}), ops.suspensions(c, now), ops.waiting_per_destination(c)

        runtime, susp, queued = await self.writer.read(read)
        live = runtime.get("destinations", {})
        csrf = auth.csrf_token(self.key, s) if s.can_act else ""
        rows = []
        for n in sorted(set(live) | set(susp) | set(queued)):
            i = live.get(n, {})
            rate = i.get("effective_rate")
            conf = i.get("configured_rate")
            # the AIMD slow-down: the share of the configured rate allowed now
            aimd = f" ({rate / conf:.0%})" if rate is not None and conf else ""
            until = ops.iso_utc(susp[n][0]) if n in susp else ""
            acts = ""
            if s.can_act:
                acts = post_form(
                    "/console/destinations/act",
                    csrf,
                    {"name": n, "action": "resume" if n in susp else "suspend"},
                    "Resume" if n in susp else "Suspend 1 h",
                ) + post_form(
                    "/console/destinations/act",
                    csrf,
                    {"name": n, "action": "reset"},
                    "Reset",
                    "plain",
                )
            rows.append(
                [
                    h(n),
                    str(queued.get(n, 0)),
                    h(i.get("circuit", "-")),
                    "-" if rate is None else h(f"{rate:.2f}{aimd}"),
                    h(f"{i.get('active_connections', '-')}/{i.get('effective_connections', '-')}"),
                    h(f"{i.get('delivered_today', 0)} / {i.get('daily_limit') or '-'}"),
                    h(until or i.get("suspended_until") or ""),
                    acts,
                ]
            )
        dests = table(
            [
                "destination",
                "queued",
                "circuit",
                "rate/s (of configured)",
                "conns (in use/max)",
                "today / ceiling",
                "suspended until",
                "",
            ],
            rows,
            num=[1, 3],
        )
        ids = runtime.get("identities", {})
        idt = table(
            ["identity", "today", "daily ceiling", "warm-up step"],
            [
                [
                    h(k),
                    str(v.get("today", 0)),
                    h(v.get("limit") or "-"),
                    h(v.get("warmup_limit") or "-"),
                ]
                for k, v in sorted(ids.items())
            ],
            num=[1, 2, 3],
        )
        return f"{dests}<h2>Sending identities</h2>{idt}"

    async def _destination_act(self, form: dict[str, list[str]], s: auth.Session) -> str:
        name = (form.get("name") or [""])[0].lower()[:255]
        action = (form.get("action") or [""])[0]
        now = time.time()
        if not name:
            raise Refused(400, "no destination named")
        if action == "suspend":
            until = now + 3600
            await self._act(
                s,
                "destination_suspend",
                {"name": name, "until": until},
                lambda c: ops.suspend_destination(c, name, until, "console"),
            )
            text = f"suspended {name} until {ops.iso_utc(until)}"
        elif action == "resume":

            def resume(c: sqlite3.Connection) -> int:
                ops.engine_command(c, "kick", name, now)
                return ops.resume_destination(c, name, now)

            n = await self._act(s, "destination_resume", {"name": name}, resume)
            text = f"resumed {name}: {n} recipients due now"
        elif action == "reset":
            n = await self._act(
                s,
                "destination_reset",
                {"name": name},
                lambda c: ops.reset_destination(c, name, now),
            )
            text = f"reset {name}: circuit closed, slow-down cleared; {n} recipients due now"
        else:
            raise Refused(400, f"unknown action {action!r}")
        return f'<p class="banner">{h(text)}</p><p>{link(url("destinations"), "Back")}</p>'

    # --- suppressions, dead letters, alerts, feedback ----------------------------------------

    async def _suppressions_body(self, q: dict[str, list[str]], s: auth.Session) -> str:
        needle = (q.get("q") or [""])[0].strip().lower()[:320]
        like = "%" + needle.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"

        def read(c: sqlite3.Connection) -> tuple[int, int, list[dict[str, Any]]]:
            # in SQL, the newest SHOWN first: a long list is never read whole for a page
            total = int(c.execute("SELECT count(*) FROM suppression").fetchone()[0])
            where = " WHERE address LIKE ? ESCAPE '\\'" if needle else ""
            args = [like] if needle else []
            n = int(c.execute(f"SELECT count(*) FROM suppression{where}", args).fetchone()[0])
            rows = c.execute(
                "SELECT address, scope, reason, created_at, source FROM suppression"
                f"{where} ORDER BY created_at DESC LIMIT {SHOWN}",
                args,
            ).fetchall()
            keys = ("address", "scope", "reason", "created_at", "source")
            docs = [dict(zip(keys, r, strict=True)) for r in rows]
            for d in docs:
                d["scope"] = d["scope"] or "global"
            return total, n, docs

        total, found, hits = await self.writer.read(read)
        csrf = auth.csrf_token(self.key, s) if s.can_act else ""
        out_rows = []
        for r in hits:
            rm = ""
            if s.can_act:
                scope = "" if r["scope"] == "global" else r["scope"]
                rm = post_form(
                    "/console/suppressions/act",
                    csrf,
                    {"action": "remove", "address": r["address"], "scope": scope},
                    "Remove",
                    "plain",
                )
            out_rows.append(
                [
                    h(r["address"]),
                    h(r["scope"]),
                    h(r["reason"]),
                    h(ops.iso_utc(r["created_at"])),
                    h(r["source"]),
                    rm,
                ]
            )
        search = (
            f'<form class="filters" method="get" action="/console/suppressions">'
            f'<label>Address contains<input name="q" value="{h(needle)}"></label>'
            f'<button type="submit">Search</button> {link(url("suppressions.csv"), "CSV export")}'
            "</form>"
        )
        add = ""
        if s.can_act:
            add = (
                f'<form class="filters" method="post" action="/console/suppressions/act">'
                f"{hidden('csrf', csrf)}{hidden('action', 'add')}"
                f'<label>Address<input name="address" required></label>'
                f'<label>Reason<input name="reason" required></label>'
                f'<button type="submit">Add</button></form>'
            )
        shown = f", the newest {len(hits)} shown" if found > len(hits) else ""
        count = f'<p class="muted">{found} of {total} entries{shown}</p>'
        return (
            search
            + add
            + count
            + table(["address", "scope", "reason", "since", "source", ""], out_rows)
        )

    async def _suppression_act(self, form: dict[str, list[str]], s: auth.Session) -> str:
        action = (form.get("action") or [""])[0]
        address = (form.get("address") or [""])[0].strip().strip("<>")[:320]
        if "@" not in address:
            raise Refused(400, "an address is local@domain")
        now = time.time()
        if action == "add":
            reason = (form.get("reason") or ["operator"])[0][:200] or "operator"
            await self._act(
                s,
                "suppression_add",
                {"address": address, "reason": reason},
                lambda c: ops.suppression_add(c, address, reason, now),
            )
            text = f"{address} added to the suppression list"
        elif action == "remove":
            scope = (form.get("scope") or [""])[0]
            ok = await self._act(
                s,
                "suppression_remove",
                {"address": address, "scope": scope},
                lambda c: ops.suppression_remove(c, address, scope),
            )
            text = f"{address} removed" if ok else f"{address} was not on the list"
        else:
            raise Refused(400, f"unknown action {action!r}")
        return f'<p class="banner">{h(text)}</p><p>{link(url("suppressions"), "Back")}</p>'

    async def _dead_body(self, q: dict[str, list[str]]) -> str:
        """Messages with a bounced or failed recipient, newest first: found from the
        recipients' state index (a scan of every message for its state took seconds at a
        million), a page at a time keyed on the newest dead recipient's row id."""
        before = (q.get("before") or [""])[0]
        cursor = int(before) if before.isdigit() else None

        def read(c: sqlite3.Connection) -> list[tuple[int, dict[str, Any]]]:
            rows = c.execute(
                "SELECT msg_id, max(id) AS last FROM recipients"
                " WHERE state IN ('bounced', 'failed')"
                + ("" if cursor is None else " AND id < ?")
                + " GROUP BY msg_id ORDER BY last DESC LIMIT ?",
                ([] if cursor is None else [cursor]) + [PAGE + 1],
            ).fetchall()
            out = []
            for msg_id, last in rows:
                found = ops.list_messages(c, include_finished=True, queue_id=msg_id)
                if found:
                    out.append((int(last), found[0]))
            return out

        msgs = await self.writer.read(read)
        rows = [
            [
                link(url(f"message/{m['id']}"), m["id"]),
                h(m["created_at"]),
                h(m["sender"] or "<>"),
                h(
                    ", ".join(
                        r["address"] for r in m["recipients"] if r["state"] in ("bounced", "failed")
                    )[:200]
                ),
                h(next((r["last_reply"] for r in m["recipients"] if r["last_reply"]), "")[:160]),
            ]
            for _last, m in msgs[:PAGE]
        ]
        pager = ""
        if len(msgs) > PAGE:
            nxt = link(url("dead", before=msgs[PAGE - 1][0]), "Older →")
            pager = f'<p class="pager">{nxt}</p>'
        return (
            table(["queue id", "arrived", "sender", "dead recipients", "last reply"], rows) + pager
        )

    async def _alerts_body(self) -> str:
        rows = await self.writer.read(lambda c: alerts_mod.recent(c, 100))
        return table(
            ["last", "severity", "event", "count", "summary", "delivery"],
            [
                [
                    h(a["last_at"]),
                    status({"critical": "critical", "warning": "warning"}.get(a["severity"], "ok"))
                    + " "
                    + h(a["severity"]),
                    h(a["event"]),
                    str(a["count"]),
                    h(a["summary"]),
                    h(
                        "sent " + a["sent_at"]
                        if a["sent_at"]
                        else f"pending {', '.join(a['pending_sinks'])}"
                        + (f" ({a['last_error']})" if a["last_error"] else "")
                    ),
                ]
                for a in rows
            ],
            num=[3],
        )

    async def _feedback_body(self) -> str:
        rows = await self.writer.read(lambda c: ops.feedback_events(c, 200))
        return table(
            ["at", "provider", "type", "recipient", "outcome", "message", "reason"],
            [
                [
                    h(ops.iso_utc(r["at"])),
                    h(r["provider"]),
                    h(r["type"]),
                    h(r["recipient"]),
                    h(r["outcome"]),
                    link(url(f"message/{r['msg_id']}"), r["msg_id"]) if r["msg_id"] else "",
                    h(r["reason"] or ""),
                ]
                for r in rows
            ],
        )
