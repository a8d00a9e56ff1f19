"""`make screenshots`: a PNG of each console page in a folder (docs/console/ for the README).

A daemon on a temporary spool with demo traffic through a real upstream on loopback: mail
delivered, deferred (a 451), bounced (a 550), held by the operator, a suppression. A fresh
daemon has only its current minute, so the charts' last day is seeded into
`console_minutes` with a made-up daily curve before the daemon starts (said in the
README's caption); everything else on the pages is what the daemon did.
"""

from __future__ import annotations

import math
import random
import sys
import tempfile
import time
from pathlib import Path

from relay.ops.console import auth, rollup
from relay.spool import db
from tests.console_browser import LAUNCH_ARGS, chromium_path, why_unavailable
from tests.harness import RelayProcess, Upstream, make_message, send

PAGES = [
    ("overview", "/console/"),
    ("queue", "/console/queue"),
    ("message", None),
    ("destinations", "/console/destinations"),
    ("suppressions", "/console/suppressions"),
    ("dead-letters", "/console/dead"),
]


def seed(spool: Path, now: float) -> None:
    conn = db.open_spool(spool)
    rnd = random.Random(7)
    minute = int(now // 60)
    with db.transaction(conn):
        for m in range(minute - 24 * 60, minute - 1):
            day = 0.55 + 0.45 * math.sin((m % 1440) / 1440 * 2 * math.pi - 1.9)
            acc = max(0, int(40 * day + rnd.gauss(0, 4)))
            counts = {
                "accepted": acc,
                "delivered": max(0, acc - rnd.randint(0, 3)),
                "deferred": rnd.randint(0, 3),
                "bounced": 1 if rnd.random() < 0.2 else 0,
                "suppressed": 1 if rnd.random() < 0.05 else 0,
            }
            p50 = 0.4 + 0.2 * day + rnd.random() * 0.1
            rollup.write_minute(
                conn,
                rollup.Minute(
                    m, counts, int(20 * day + rnd.randint(0, 5)), p50, p50 * 2.2, p50 * 5
                ),
            )
    conn.close()


def main(out: Path) -> int:
    why = why_unavailable()
    if why is not None:
        print(f"screenshots: {why}", file=sys.stderr)
        return 1
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    up = Upstream()
    up.rcpt_reply = lambda a: (
        "451 4.7.1 Greylisted, try again later"
        if a.startswith("grey")
        else "550 5.1.1 No such user"
        if a.startswith("nobody")
        else None
    )
    up.start()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "users").write_text(auth.user_line("olga", "operator", "demo-password") + "\n")
        (work / "spool").mkdir()
        seed(work / "spool", time.time())
        r = RelayProcess(
            work,
            {
                "hostname": "relay.example.com",
                "admin": {"users_file": "users"},
                "upstream": {
                    "mode": "smarthost",
                    "smarthost": {"host": "127.0.0.1", "port": up.port, "tls": "none"},
                },
                "retry": {"schedule": ["10m"], "max_age": "1d", "min_delay": "1s"},
            },
        )
        r.start()
        try:
            for i in range(12):
                send(
                    r.port,
                    "app@example.com",
                    [f"user{i}@example.org"],
                    make_message(i, subject=f"Your receipt #{1000 + i}"),
                )
            for i in range(3):
                send(
                    r.port,
                    "news@example.com",
                    [f"grey{i}@example.net"],
                    make_message(20 + i, subject="Weekly digest", headers={"Precedence": "bulk"}),
                )
            send(r.port, "app@example.com", ["nobody@example.org"], make_message(30))
            send(r.port, "app@example.com", ["grey-hold@example.net"], make_message(31))
            r.wait_until(
                lambda: any(
                    m["state"] == "deferred" and m["sender"] == "app@example.com" for m in r.queue()
                ),
                what="a deferral",
            )
            held = next(
                m["id"]
                for m in r.queue()
                if m["recipients"][0]["address"] == "grey-hold@example.net"
            )
            r.cli("queue", "hold", held, check=True)
            r.cli(
                "suppression",
                "add",
                "complainer@example.org",
                "--reason",
                "complaint (feedback loop)",
                check=True,
            )
            r.wait_until(
                lambda: sum(1 for m in r.queue() if m["state"] == "failed") >= 1, what="a bounce"
            )
            time.sleep(2.5)  # the daemon's runtime view (destinations) is written every 2 s
            msg = next(
                m["id"] for m in r.queue() if m["recipients"][0]["address"].startswith("grey0")
            )
            base = f"http://127.0.0.1:{r.admin_port}"
            with sync_playwright() as p:
                b = p.chromium.launch(executable_path=chromium_path(), args=LAUNCH_ARGS)
                page = b.new_page(viewport={"width": 1360, "height": 900})
                page.goto(f"{base}/console/login")
                page.screenshot(path=str(out / "login.png"))
                page.fill("input[name=name]", "olga")
                page.fill("input[name=password]", "demo-password")
                page.click("button[type=submit]")
                page.wait_for_url(f"{base}/console/")
                for name, path in PAGES:
                    page.goto(base + (path or f"/console/message/{msg}"))
                    page.screenshot(path=str(out / f"{name}.png"), full_page=True)
                    print(f"screenshots: {out / f'{name}.png'}")
                b.close()
        finally:
            r.stop()
            up.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/console")))
