"""Routes and upstreams end to end: failover to a backup within the same attempt (refused,
421 greeting, bad certificate, open circuit), per-sender routes with their own credentials,
OAuth2 (XOAUTH2 against a real HTTP token endpoint on loopback; OAUTHBEARER from a token
command), and rewriting. Real daemon, real aiosmtpd upstreams, all on loopback."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.harness import (
    RelayProcess,
    Upstream,
    deep_merge,
    fast_config,
    free_port,
    make_message,
    send,
    server_context,
)
from tests.webhook import Post, Receiver

pytestmark = pytest.mark.slow

SENDER = "app@example.com"
FAST: dict[str, Any] = fast_config("2s")


def plain(up: Upstream | int, **extra: Any) -> dict[str, Any]:
    port = up if isinstance(up, int) else up.port
    return {"host": "127.0.0.1", "port": port, "tls": "none", **extra}


def routed(upstreams: dict[str, Any], routes: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return deep_merge(FAST, {"upstreams": upstreams, "routes": routes, **extra})


def only_recipient(r: RelayProcess) -> dict[str, Any]:
    msgs = r.cli_json("queue", "list", "--all")
    assert len(msgs) >= 1
    return dict(msgs[-1]["recipients"][0], queue_id=msgs[-1]["id"])


def wait_delivered(r: RelayProcess, n: int) -> None:
    r.wait_until(
        lambda: list(r.recipient_states().values()).count("delivered") == n, what=f"{n} delivered"
    )


def events(r: RelayProcess, name: str) -> list[dict[str, Any]]:
    return [e for e in r.events() if e.get("event") == name]


# --- failover ------------------------------------------------------------------------------


def test_a_backup_carries_failover_mail_under_its_own_daily_ceiling(upstream, relay) -> None:
    backup = upstream()
    r = relay(
        config=routed(
            {"primary": plain(free_port()), "backup": plain(backup)},
            [{"via": ["primary", "backup"]}],
            destinations={"backup": {"daily_limit": 1}},
        )
    )
    assert send(r.port, SENDER, ["one@example.org"], make_message(1)) == {}
    backup.wait_for(1)
    wait_delivered(r, 1)

    def today() -> dict[str, int]:  # the daemon's view, written every 2 s
        return {d["name"]: d.get("delivered_today", 0) for d in r.cli_json("destination", "list")}

    r.wait_until(lambda: today().get("backup") == 1, what="counted where it went")
    assert today().get("primary", 0) == 0
    # the backup's ceiling is reached: failover mail waits instead of passing it
    assert send(r.port, SENDER, ["two@example.org"], make_message(2)) == {}
    r.wait_until(
        lambda: any("daily ceiling" in e["msg"] for e in events(r, "failover")),
        what="the backup skipped for its ceiling",
    )
    r.wait_until(lambda: r.recipient_states().get("two@example.org") == "deferred", what="deferred")
    time.sleep(1.5)  # a retry (schedule 1s) goes the same way
    assert len(backup.received) == 1
    assert r.recipient_states().get("two@example.org") == "deferred"


def test_a_refusing_primary_fails_over_to_the_backup_in_the_same_attempt(upstream, relay) -> None:
    backup = upstream()
    r = relay(
        config=routed(
            {"primary": plain(free_port()), "backup": plain(backup)},
            [{"via": ["primary", "backup"]}],
        )
    )
    assert send(r.port, SENDER, ["user@example.org"], make_message(1)) == {}
    got = backup.wait_for(1)
    assert got[0].rcpt_tos == ["user@example.org"]
    wait_delivered(r, 1)
    rc = only_recipient(r)
    assert rc["attempts"] == 1  # the same attempt, not a retry
    show = r.cli_json("queue", "show", rc["queue_id"])
    assert [a["destination"] for a in show["attempt_log"]] == ["backup"]
    assert show["attempt_log"][0]["outcome"] == "delivered"
    fo = events(r, "failover")
    assert fo and fo[0]["destination"] == "primary" and fo[0]["next"] == "backup"
    assert "refused" in fo[0]["reply"]


def test_a_421_greeting_then_an_open_circuit_send_mail_to_the_backup(upstream, relay) -> None:
    primary, backup = upstream(), upstream()
    primary.connect_reply = "421 4.3.2 primary.test shutting down"
    r = relay(
        config=routed(
            {"primary": plain(primary), "backup": plain(backup)},
            [{"via": ["primary", "backup"]}],
            destinations={"primary": {"circuit_failures": 1, "circuit_cooldown": "1h"}},
        )
    )
    assert send(r.port, SENDER, ["a@example.org"], make_message(1)) == {}
    backup.wait_for(1)
    r.wait_until(lambda: events(r, "circuit_open"), what="primary's circuit open")
    assert events(r, "circuit_open")[0]["destination"] == "primary"
    tried = primary.connections
    # the next message skips the open primary without even connecting to it
    assert send(r.port, SENDER, ["b@example.org"], make_message(2)) == {}
    backup.wait_for(2)
    wait_delivered(r, 2)
    assert primary.connections == tried

    def listed() -> dict[str, Any]:
        return {d["name"]: d for d in r.cli_json("destination", "list")}

    # the daemon's snapshot is written every 2 s: one taken between the failover and
    # the circuit's opening lists primary "closed" until the next (a fresh-clone CI run)
    r.wait_until(
        lambda: listed().get("primary", {}).get("circuit") == "open" and "backup" in listed(),
        what="both upstreams in the daemon's snapshot, primary's circuit open",
    )
    assert listed()["primary"]["circuit"] == "open"
    assert listed()["backup"]["circuit"] == "closed"
    assert listed()["backup"]["upstream"] == f"127.0.0.1:{backup.port}"


def test_a_primary_with_a_bad_certificate_fails_over_and_is_critical(upstream, relay, ca) -> None:
    primary = upstream(tls_context=server_context(ca))  # a CA the relay does not trust
    backup = upstream()
    r = relay(
        config=routed(
            {
                "primary": {"host": "127.0.0.1", "port": primary.port, "tls": "starttls"},
                "backup": plain(backup),
            },
            [{"via": ["primary", "backup"]}],
        )
    )
    assert send(r.port, SENDER, ["user@example.org"], make_message(1)) == {}
    backup.wait_for(1)
    assert primary.received == []
    assert events(r, "upstream_config_error")[0]["destination"] == "primary"

    def primary_check() -> str | None:
        url = f"http://127.0.0.1:{r.admin_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                doc = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            doc = json.loads(e.read())
        return {c["name"]: c["status"] for c in doc["checks"]}.get("destination:primary")

    r.wait_until(
        lambda: primary_check() == "critical", timeout=10, what="destination:primary critical"
    )


# --- per-sender routes and credentials -------------------------------------------------------


def test_routes_by_sender_domain_reach_different_upstreams_with_their_own_credentials(
    upstream, relay, tmp_path: Path
) -> None:
    a = upstream(auth={"app-a": "pass-a"})
    b = upstream(auth={"billing": "pass-b"})
    (tmp_path / "pa").write_text("pass-a\n")
    (tmp_path / "pb").write_text("pass-b\n")
    r = relay(
        config=routed(
            {
                "acct-a": plain(a, username="app-a", password_file=str(tmp_path / "pa")),
                "acct-b": plain(
                    b, username="billing", password_file=str(tmp_path / "pb"), auth="plain"
                ),
            },
            [
                {"sender_domain": "billing.example.com", "via": ["acct-b"]},
                {"recipient_domain": ["partner.test"], "via": ["acct-b"]},
                {"via": ["acct-a"]},
            ],
        )
    )
    assert send(r.port, SENDER, ["u1@example.org"], make_message(1)) == {}
    assert send(r.port, "invoices@billing.example.com", ["u2@example.org"], make_message(2)) == {}
    assert send(r.port, SENDER, ["u3@partner.test", "u4@example.org"], make_message(3)) == {}
    wait_delivered(r, 4)
    got_a = {rc: m.auth for m in a.received for rc in m.rcpt_tos}
    got_b = {rc: m.auth for m in b.received for rc in m.rcpt_tos}
    assert got_a == {"u1@example.org": "app-a", "u4@example.org": "app-a"}
    assert got_b == {"u2@example.org": "billing", "u3@partner.test": "billing"}
    # the queue names the upstream each recipient goes through
    dests = {
        rc["address"]: rc["destination"]
        for m in r.cli_json("queue", "list", "--all")
        for rc in m["recipients"]
    }
    assert dests["u2@example.org"] == "acct-b" and dests["u1@example.org"] == "acct-a"


# --- OAuth2 --------------------------------------------------------------------------------


class TokenEndpoint:
    """A real OAuth2 token endpoint on loopback: issues tok-1, tok-2, ... and tells the
    upstream which ones it accepts."""

    def __init__(self, rec: Receiver, up: Upstream, user: str, expires_in: int = 3600):
        self.rec, self.up, self.user = rec, up, user
        self.expires_in = expires_in
        self.issued = 0
        self.valid = True  # tokens issued are accepted by the upstream
        rec.answer = self.answer

    def answer(self, post: Post) -> tuple[int, dict[str, Any]]:
        form = post.form
        if form.get("client_secret") != "s3cret":
            return 401, {"error": "invalid_client"}
        self.issued += 1
        tok = f"tok-{self.issued}"
        if self.valid:
            assert self.up.oauth is not None
            self.up.oauth.setdefault(self.user, set()).add(tok)
        return 200, {"access_token": tok, "token_type": "Bearer", "expires_in": self.expires_in}


def test_xoauth2_with_a_token_endpoint_issued_cached_expired_refreshed_refused(
    upstream, relay, tmp_path: Path
) -> None:
    user = "billing@example.com"
    up = upstream(oauth={user: set()})
    rec = Receiver().start()
    try:
        ep = TokenEndpoint(rec, up, user, expires_in=3600)
        (tmp_path / "cs").write_text("s3cret\n")
        r = relay(
            config=routed(
                {
                    "m365": plain(
                        up,
                        username=user,
                        auth="xoauth2",
                        oauth={
                            "token_url": rec.url,
                            "client_id": "app-id",
                            "client_secret_file": str(tmp_path / "cs"),
                            "scope": "https://outlook.office365.com/.default",
                        },
                    )
                },
                [{"via": ["m365"]}],
                destinations={"m365": {"max_messages_per_connection": 1}},
            )
        )
        assert send(r.port, SENDER, ["u1@example.org"], make_message(1)) == {}
        up.wait_for(1)
        # issued: one client-credentials grant with our client and scope
        assert len(rec.posts) == 1
        form = rec.posts[0].form
        assert form == {
            "grant_type": "client_credentials",
            "client_id": "app-id",
            "client_secret": "s3cret",
            "scope": "https://outlook.office365.com/.default",
        }
        assert up.auth_seen[-1] == ("XOAUTH2", user, "tok-1")
        # cached: a new connection, no new grant
        assert send(r.port, SENDER, ["u2@example.org"], make_message(2)) == {}
        up.wait_for(2)
        assert len(rec.posts) == 1 and up.auth_seen[-1][2] == "tok-1"
        # refused (revoked): refreshed once within the attempt, and delivered
        up.oauth[user] = set()
        assert send(r.port, SENDER, ["u3@example.org"], make_message(3)) == {}
        up.wait_for(3)
        assert len(rec.posts) == 2 and up.auth_seen[-1][2] == "tok-2"
        rc = only_recipient(r)
        assert rc["attempts"] == 1
        # refused for good (tokens issued are no longer accepted): deferred, critical
        ep.valid = False
        up.oauth[user] = set()
        assert send(r.port, SENDER, ["u4@example.org"], make_message(4)) == {}
        r.wait_until(lambda: events(r, "upstream_config_error"), what="config error")
        assert r.recipient_states()["u4@example.org"] in ("deferred", "sending")
        assert "s3cret" not in r.logs() and "tok-" not in r.logs()
        # fixed: the next grant's token works and the mail goes
        ep.valid = True
        r.wait_until(
            lambda: r.recipient_states()["u4@example.org"] == "delivered",
            timeout=20,
            what="delivered after the fix",
        )
    finally:
        rec.stop()


def test_an_expired_token_is_refreshed_before_use(upstream, relay, tmp_path: Path) -> None:
    user = "app@example.com"
    up = upstream(oauth={user: set()})
    rec = Receiver().start()
    try:
        TokenEndpoint(rec, up, user, expires_in=61)  # the cache keeps it until 60 s before
        (tmp_path / "cs").write_text("s3cret\n")
        r = relay(
            config=routed(
                {
                    "gw": plain(
                        up,
                        username=user,
                        auth="xoauth2",
                        oauth={
                            "token_url": rec.url,
                            "client_id": "id",
                            "client_secret_file": str(tmp_path / "cs"),
                        },
                    )
                },
                [{"via": ["gw"]}],
                destinations={"gw": {"max_messages_per_connection": 1}},
            )
        )
        assert send(r.port, SENDER, ["u1@example.org"], make_message(1)) == {}
        up.wait_for(1)
        time.sleep(1.2)
        assert send(r.port, SENDER, ["u2@example.org"], make_message(2)) == {}
        up.wait_for(2)
        assert len(rec.posts) == 2
        assert [s[2] for s in up.auth_seen] == ["tok-1", "tok-2"]
    finally:
        rec.stop()


def test_oauthbearer_with_a_token_command(upstream, relay) -> None:
    user = "app@example.com"
    up = upstream(oauth={user: {"cmd-token-7"}})
    r = relay(
        config=routed(
            {
                "gw": plain(
                    up,
                    username=user,
                    auth="oauthbearer",
                    oauth={"token_command": "echo cmd-token-7"},
                )
            },
            [{"via": ["gw"]}],
        )
    )
    assert send(r.port, SENDER, ["u1@example.org"], make_message(1)) == {}
    got = up.wait_for(1)
    assert got[0].auth == user
    assert up.auth_seen == [("OAUTHBEARER", user, "cmd-token-7")]


# --- rewriting -------------------------------------------------------------------------------


def test_a_route_rewrites_the_envelope_sender_and_from(upstream, relay) -> None:
    up, other = upstream(), upstream()
    r = relay(
        config=routed(
            {"ses": plain(up), "plain": plain(other)},
            [
                {
                    "sender_domain": "legacy.example",
                    "via": ["ses"],
                    "rewrite": {
                        "envelope_sender": "bounces@verified.example",
                        "from": "noreply@verified.example",
                        "reply_to_original": True,
                    },
                },
                {"via": ["plain"]},
            ],
        )
    )
    msg = make_message(1).replace(
        b"From: app@example.com", b"From: Billing Team <billing@legacy.example>"
    )
    assert send(r.port, "billing@legacy.example", ["u1@example.org"], msg) == {}
    assert send(r.port, SENDER, ["u2@example.org"], make_message(2)) == {}
    got = up.wait_for(1)[0]
    assert got.mail_from == "bounces@verified.example"
    text = got.data.decode()
    assert "From: Billing Team <noreply@verified.example>\r\n" in text
    assert "Reply-To: Billing Team <billing@legacy.example>\r\n" in text
    assert "X-Original-From: Billing Team <billing@legacy.example>\r\n" in text
    head = text.split("\r\n\r\n", 1)[0]
    assert [ln for ln in head.split("\r\n") if ln.lower().startswith("from:")] == [
        "From: Billing Team <noreply@verified.example>"
    ]
    # the other route is untouched, and the queue keeps the original
    plain_got = other.wait_for(1)[0]
    assert plain_got.mail_from == SENDER and b"X-Original-From" not in plain_got.data
    wait_delivered(r, 2)


def test_replies_of_an_upstream_that_answered_are_final_for_the_attempt(upstream, relay) -> None:
    primary, backup = upstream(), upstream()
    primary.rcpt_reply = lambda a: "550 5.1.1 no such user" if a.startswith("gone") else None
    primary.data_reply = lambda env: "451 4.3.0 try later"
    r = relay(
        config=routed(
            {"primary": plain(primary), "backup": plain(backup)},
            [{"via": ["primary", "backup"]}],
        )
    )
    assert send(r.port, SENDER, ["gone@example.org", "ok@example.org"], make_message(1)) == {}
    r.wait_until(
        lambda: (
            r.recipient_states().get("gone@example.org") == "bounced"
            and r.recipient_states().get("ok@example.org") in ("deferred", "sending")
        ),
        what="bounced at the primary, the other deferred",
    )
    assert backup.connections == 0 and backup.received == []  # never asked the backup
    assert not events(r, "failover")
