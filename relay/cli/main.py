"""The `relay` command: argument parsing and printing only.

Every command reads the spool directly (so it works whether or not the daemon runs); a
change is committed to the spool and the daemon picks it up within 2 seconds.
Exit codes: 0 ok, 1 failure (e.g. an unknown queue id), 2 usage, 78 bad config.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from relay import __version__
from relay.config.tree import EX_CONFIG, ConfigError, load_config, parse_duration
from relay.delivery.outcomes import ROWS
from relay.mail.address import AddressError, check_mailbox, printable
from relay.ops.logs import log_event, redact_text, set_secrets, setup_logging
from relay.spool import bodies, db, ops
from relay.spool.dedup import normalize_message_id
from relay.spool.model import WAITING, MsgState, RcptState

T = TypeVar("T")

# the words the commands take and print for states, from relay/spool/model.py and the
# outcome table (relay/delivery/outcomes.py)
_MSG_STATES = [s.value for s in MsgState]
_DEAD_STATES = "/".join(dict.fromkeys(r.state.value for r in ROWS.values() if r.dead))

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
log = logging.getLogger("relay.cli.main")


class CliError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relay",
        description="Local SMTP relay: daemon and CLI",
        epilog="`relay COMMAND --help` for a command's options; man 8 relay for them all.",
    )
    p.add_argument("--version", action="version", version=f"relay {__version__}")
    # -c and --json work before the verb (`relay -c FILE queue list`) and after it: the
    # verb's copies default to SUPPRESS so they never overwrite what was given before it
    p.add_argument(
        "-c", "--config", help="config file (else $RELAY_CONFIG, else /etc/relay/relay.yaml)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-c",
        "--config",
        default=argparse.SUPPRESS,
        help="config file (else $RELAY_CONFIG, else /etc/relay/relay.yaml)",
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")

    sub.add_parser("serve", parents=[common], help="run the daemon in the foreground")
    sub.add_parser(
        "check-config", parents=[common], help="validate the config and print it, secrets redacted"
    )
    sub.add_parser("stats", parents=[common], help="queue counts and destination state")
    sub.add_parser(
        "fleet",
        parents=[common],
        help="the relays on this spool: heartbeats and work in flight (a PostgreSQL fleet)",
    )
    sub.add_parser(
        "status",
        parents=[common],
        help="health, as a monitoring plugin: exit 0 OK, 1 WARNING, 2 CRITICAL, 3 UNKNOWN",
    )
    al = sub.add_parser("alerts", parents=[common], help="the newest alerts and their sinks")
    al.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    fb = sub.add_parser(
        "feedback", help="bounces and complaints after the 250 (webhooks, feedback mail)"
    ).add_subparsers(dest="fcmd", required=True)
    fe = fb.add_parser("events", parents=[common], help="the newest feedback events")
    fe.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    fm = fb.add_parser("mail", parents=[common], help="feedback mail received (unread: kept)")
    fm.add_argument("--unread", action="store_true", help="only mail that could not be read")
    fm.add_argument("--limit", type=int, default=50, help="at most this many (default 50)")
    fs = fb.add_parser(
        "show", parents=[common], help="one feedback mail, control characters escaped"
    )
    fs.add_argument("id", type=int, help="its id, from relay feedback mail")
    fp = fb.add_parser("purge", parents=[common], help="delete stored feedback mail")
    which = fp.add_mutually_exclusive_group(required=True)
    which.add_argument("--older-than", help="what arrived more than this long ago (e.g. 2d)")
    which.add_argument("--all", action="store_true", help="every stored feedback mail")
    fs.add_argument(
        "--raw", action="store_true", help="write the bytes as received (e.g. into a file)"
    )

    q = sub.add_parser("queue", help="inspect and repair the queue").add_subparsers(
        dest="qcmd", required=True
    )
    ql = q.add_parser("list", parents=[common], help="list messages (default: unfinished)")
    ql.add_argument(
        "--state",
        choices=[*_MSG_STATES, "maildrop"],
        help="maildrop: relay-sendmail's files waiting for the daemon to import them",
    )
    ql.add_argument("--all", action="store_true", help="include finished messages")
    ql.add_argument("--recipient", help="only messages to this address")
    ql.add_argument("--domain", help="only messages with a recipient at this domain")
    ql.add_argument("--older-than", help="only messages older than this (e.g. 1h)")
    ql.add_argument("--limit", type=int, help="at most this many messages (oldest first)")
    qf = q.add_parser(
        "find",
        parents=[common],
        help="messages (finished too) by Message-ID, upstream id or recipient",
    )
    qf.add_argument("--message-id", help="the Message-ID header, with or without <>")
    qf.add_argument("--upstream-id", help="the id the upstream gave at its 250")
    qf.add_argument("--recipient", help="a recipient address")
    qs = q.add_parser("show", parents=[common], help="one message with its attempt log")
    qs.add_argument("id", help="the queue id (or a maildrop file name)")
    qs.add_argument("--body", action="store_true", help="also print the message itself")
    qs.add_argument(
        "--raw",
        action="store_true",
        help="with --body: only the message's bytes as stored (headers and body), unescaped",
    )
    qr = q.add_parser("retry", parents=[common], help="make messages due now, attempts reset")
    qr.add_argument("ids", nargs="*", help="queue ids")
    qr.add_argument(
        "--failed", action="store_true", help=f"every dead letter ({_DEAD_STATES} recipients)"
    )
    _bulk_options(qr)
    for name, helptext in (
        ("delete", "remove messages from the queue"),
        ("hold", "park messages; they are not delivered until released"),
        ("release", "release held messages (due now)"),
    ):
        x = q.add_parser(name, parents=[common], help=helptext)
        x.add_argument("ids", nargs="*", help="queue ids")
        _bulk_options(x)
    qfl = q.add_parser("flush", parents=[common], help="every deferred recipient due now")
    qfl.add_argument("--dry-run", action="store_true", help="only say how many would change")
    qp = q.add_parser(
        "purge",
        parents=[common],
        help="delete finished messages (and their bodies) older than a duration",
    )
    qp.add_argument("--older-than", required=True, help="e.g. 1h, 2d; 0 = every finished one")
    qp.add_argument("--dry-run", action="store_true", help="only count them")
    q.add_parser(
        "summary",
        parents=[common],
        help="unfinished recipients by destination and age (like qshape)",
    )

    s = sub.add_parser("suppression", help="the suppression list").add_subparsers(
        dest="scmd", required=True
    )
    s.add_parser("list", parents=[common], help="every suppressed address, scope and source")
    sa = s.add_parser("add", parents=[common], help="suppress an address (mail to it is refused)")
    sa.add_argument("address", help="the address")
    sa.add_argument("--reason", default="added by operator", help="why, shown by list")
    sa.add_argument(
        "--scope",
        default="global",
        help="global (default), or one sending identity (shaping.identity_by)",
    )
    sr = s.add_parser("remove", parents=[common], help="lift the suppression of an address")
    sr.add_argument("address", help="the address")
    sr.add_argument(
        "--scope", default=None, help="lift only this scope's entry (default: every entry)"
    )

    d = sub.add_parser("destination", help="per-destination state and controls").add_subparsers(
        dest="dcmd", required=True
    )
    d.add_parser("list", parents=[common], help="every destination: circuit, rate, today's count")
    ds = d.add_parser("suspend", parents=[common], help="send nothing to a destination for a while")
    ds.add_argument("name", help="the destination (domain, upstream name or smarthost)")
    ds.add_argument("--for", dest="duration", default="1h", help="how long (default 1h)")
    ds.add_argument("--reason", default="suspended by operator", help="shown by list")
    dr = d.add_parser("resume", parents=[common], help="end a suspension; its mail is due now")
    dr.add_argument("name", help="the destination")
    dx = d.add_parser(
        "reset", parents=[common], help="close the circuit and clear any slow-down, now"
    )
    dx.add_argument("name", help="the destination")

    a = sub.add_parser("auth", help="inbound AUTH users").add_subparsers(dest="acmd", required=True)
    ah = a.add_parser(
        "hash",
        parents=[common],
        help="read a password on stdin (no echo on a terminal) and print its"
        " hash for a listen[].auth.users_file line",
    )
    ah.add_argument("-u", "--user", help="print the whole `USER:hash` line")

    ad = sub.add_parser("admin", help="the console's users").add_subparsers(
        dest="adcmd", required=True
    )
    ap = ad.add_parser("passwd", parents=[common], help="a users_file line (password on stdin)")
    ap.add_argument("name", help="the user's login name")
    ap.add_argument(
        "--role",
        choices=["viewer", "operator"],
        required=True,
        help="viewer reads (no bodies); operator reads bodies and acts",
    )
    ap.add_argument("--file", help="append the line to this admin.users_file (else: printed)")

    k = sub.add_parser("dkim", help="DKIM keys").add_subparsers(dest="kcmd", required=True)
    kg = k.add_parser(
        "keygen",
        parents=[common],
        help="write a new private key (mode 0600) and print the DNS TXT record to publish",
    )
    kg.add_argument("domain", help="the signing (From) domain")
    kg.add_argument("--selector", required=True, help="the DNS selector, e.g. s2026")
    kg.add_argument(
        "--algorithm",
        choices=["rsa-sha256", "ed25519-sha256"],
        default="rsa-sha256",
        help="the key type (default rsa-sha256)",
    )
    kg.add_argument("--bits", type=int, default=2048, help="RSA key size (2048-4096)")
    kg.add_argument(
        "--out",
        help="the key file (default: credentials/dkim-<domain>.<selector>.key beside the config"
        " when that folder exists, as after make install; else dkim/<domain>.<selector>.key)",
    )
    cd = sub.add_parser(
        "check-dns",
        parents=[common],
        help="SPF, DKIM, DMARC, MX, MTA-STS and TLS-RPT of a sending domain;"
        " exit 0 ok, 1 warnings, 2 errors",
    )
    cd.add_argument("domain", help="the sending domain")
    cd.add_argument("--ip", help="the address we send from, to check SPF authorises it")
    cf = sub.add_parser("config", help="about the config file").add_subparsers(
        dest="fcmd", required=True
    )
    cf.add_parser(
        "schema",
        help="print the config's JSON Schema (for editors: yaml-language-server's $schema)",
    )
    _describe(p)
    return p


def _describe(p: argparse.ArgumentParser) -> None:
    """`relay <verb> --help` opens with what the verb does: its one-line help."""
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in a._choices_actions}
            for verb, child in a.choices.items():
                child.description = child.description or helps.get(verb)
                _describe(child)


def _dkim_keygen(args: argparse.Namespace) -> int:
    """`relay dkim keygen`: needs no valid config (it makes what the config will name)."""
    from pathlib import Path

    from relay.authenticity.dkim import DkimConfigError, keygen
    from relay.config.tree import DEFAULT_PATH

    base = Path(args.config or DEFAULT_PATH).resolve().parent
    name = f"{args.domain}.{args.selector}.key"
    # installed (make install): the credentials folder the unit loads with LoadCredential=
    creds = base / "credentials"
    if args.out:
        path = Path(args.out)
    elif creds.is_dir():
        path = creds / f"dkim-{name}"
    else:
        path = base / "dkim" / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        zone = keygen(args.domain, args.selector, path, args.algorithm, args.bits)
    except (DkimConfigError, OSError) as e:
        print(f"relay: dkim keygen: {e}", file=sys.stderr)
        return EXIT_FAIL
    # a key in the credentials folder reaches the service as a copy in its own
    # $CREDENTIALS_DIRECTORY, named relay_<file> (systemd/relay.service): name it so
    key_file = str(path)
    if path.resolve().parent == creds.resolve():
        key_file = f"${{CREDENTIALS_DIRECTORY}}/relay_{path.name}"
    if args.json:
        _print_json(
            {
                "domain": args.domain,
                "selector": args.selector,
                "key_file": str(path),
                "config_key_file": key_file,
                "dns": zone,
            }
        )
        return EXIT_OK
    print(f"; private key written to {path} (mode 0600, this user's): keep it secret")
    print("; publish this record in the zone of the domain:")
    print(zone)
    print("; and add to the relay's config:")
    print(f";   dkim: {{{args.domain}: {{selector: {args.selector}, key_file: {key_file},")
    print(f";          algorithm: {args.algorithm}}}}}")
    return EXIT_OK


def _check_dns(args: argparse.Namespace, config: Any) -> int:
    import asyncio

    from relay.authenticity import checkdns
    from relay.authenticity.dkim import keys_for, public_record

    domain = args.domain.strip().lower().removesuffix(".")
    keys = [k for k in keys_for(domain, config.dkim) if k.domain == domain]
    ns = config.upstream.mx.nameservers
    try:
        checks = asyncio.run(
            checkdns.check_domain(
                domain,
                nameservers=list(ns) if ns else None,
                dkim=[(k.selector, public_record(k)) for k in keys],
                ip=args.ip,
            )
        )
    except ValueError as e:
        print(f"relay: check-dns: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        _print_json(checkdns.to_json(domain, checks))
    else:
        print(checkdns.render_text(domain, checks))
    return checkdns.exit_code(checks)


def _auth_hash(args: argparse.Namespace) -> int:
    """`relay auth hash`: the password comes from stdin (getpass, twice, on a terminal; else
    the first line), never from the command line, and is never printed."""
    import getpass

    from relay.inbound.auth import hash_password

    user = args.user
    if user is not None and (
        not user or user != user.strip() or user.startswith("#") or any(c in user for c in "\r\n\0")
    ):
        print(
            "relay: --user must be a name without surrounding spaces, line breaks or a leading #",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        if sys.stdin.isatty():
            password = getpass.getpass("Password: ")
            if getpass.getpass("Again: ") != password:
                print("relay: the passwords differ", file=sys.stderr)
                return EXIT_FAIL
        else:
            password = sys.stdin.readline().rstrip("\r\n")
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)
        return EXIT_FAIL
    if not password:
        print("relay: empty password", file=sys.stderr)
        return EXIT_FAIL
    hashed = hash_password(password)
    if args.json:
        _print_json({"user": args.user, "hash": hashed})
    else:
        print(f"{args.user}:{hashed}" if args.user is not None else hashed)
    return EXIT_OK


STALE_AFTER = 15.0  # seconds: a daemon snapshot older than this means the daemon is gone


def _alive(pid: object) -> bool:
    import os

    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True


def _fleet(args: argparse.Namespace, conn: sqlite3.Connection, now: float) -> int:
    nodes = ops.list_nodes(conn, now, args.lease)
    if args.json:
        _print_json(nodes)
    else:
        _print_nodes(nodes)
    return EXIT_OK


def _print_nodes(nodes: list[dict[str, Any]]) -> None:
    alive = sum(1 for n in nodes if n["alive"])
    print(f"fleet: {len(nodes)} node{'s' * (len(nodes) != 1)}, {alive} alive")
    for n in nodes:
        print(
            f"  {n['node']:<24} {'alive' if n['alive'] else 'SILENT':<6}"
            f" heartbeat {n['heartbeat_age']:.0f}s ago, in flight {n['inflight']},"
            f" claims {n['claims']}, host {n.get('host', '?')} pid {n.get('pid', '?')}"
            f" (since {n['started_at']})"
        )


def _status(args: argparse.Namespace, spool: Any) -> int:
    """`relay status`: the daemon's health file, judged like a monitoring plugin. Reads no
    database: it works when the spool is the problem."""
    from relay.ops.health import HEALTH_FILE, UNKNOWN_EXIT, plugin_output

    path = spool / HEALTH_FILE
    doc: dict[str, Any]
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        doc = {"status": "unknown", "detail": "daemon not running (no health file)"}
    except (OSError, ValueError) as e:
        doc = {"status": "unknown", "detail": f"cannot read {path}: {e}"}
    if doc.get("status") != "unknown":
        age = time.time() - float(doc.get("updated_ts", 0))
        if not _alive(doc.get("pid")):
            doc = {
                "status": "unknown",
                "detail": f"daemon not running (pid {doc.get('pid')} is gone)",
            }
        elif age > STALE_AFTER:
            doc = {
                "status": "unknown",
                "detail": f"daemon not responding (health last updated {age:.0f}s ago)",
            }
    code, text = plugin_output(doc)
    if args.json:
        doc = {**doc, "exit_code": code}
        if code == UNKNOWN_EXIT:
            doc["status"] = "unknown"
        _print_json(doc)
    else:
        print(text)
        fleet = doc.get("fleet")
        if fleet:  # as this node saw the fleet at its last heartbeat
            print(f"node {fleet['node']}; ", end="")
            _print_nodes(fleet["nodes"])
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "serve":
        from relay.daemon import serve

        return serve(args.config)
    if args.cmd == "auth":  # needs no config
        return _auth_hash(args)
    if args.cmd == "admin":  # needs no config (relay/ops/console/passwd.py)
        from relay.ops.console.passwd import passwd

        return passwd(args.name, args.role, args.file)
    if args.cmd == "dkim":  # needs no valid config: it makes keys the config will name
        return _dkim_keygen(args)
    if args.cmd == "config":  # `config schema`: needs no config
        from relay.config.tree import json_schema

        print(json.dumps(json_schema(), indent=2))
        return EXIT_OK
    # outside the unit, secrets named by ${CREDENTIALS_DIRECTORY} are read where the unit
    # loads them from (relay/config/credentials.py)
    from relay.config import credentials
    from relay.config.tree import DEFAULT_PATH

    source = Path(args.config or os.environ.get("RELAY_CONFIG") or DEFAULT_PATH)
    credentials.use_source_folder(source.resolve().parent / "credentials")
    try:
        config = load_config(args.config)
    except ConfigError as e:
        text = redact_text(str(e))  # a bad URL's message may quote it
        print(f"relay: {text}", file=sys.stderr)
        if args.cmd == "status":
            print(f"UNKNOWN: bad config: {text}")
            return 3
        return EX_CONFIG
    except Exception as e:  # a value the reader did not foresee: still one line, never a trace
        print(f"relay: config: cannot be read ({type(e).__name__}: {e})", file=sys.stderr)
        return EX_CONFIG
    set_secrets(config.secrets())
    setup_logging(config.log.level, "text", config.log.unmask)
    # the destination a recipient goes through: its route's first upstream, or its domain
    args.routing = config.routing
    args.lease = config.fleet.lease  # a node is alive while its heartbeat is this fresh
    args.maildrop = config.maildrop_dir()  # `queue list` shows its files too
    if args.cmd == "status":  # needs no database: it must work when the spool is broken
        return _status(args, config.spool_path)
    if args.cmd == "check-dns":  # DNS only, no spool
        return _check_dns(args, config)
    if args.cmd == "check-config":
        for warning in config.warnings():
            print(f"relay: warning: {redact_text(warning)}", file=sys.stderr)
        if args.json:
            print(json.dumps(config.redacted(), indent=2, sort_keys=True, default=str))
        else:
            import yaml

            print(f"# {config.path}: OK")
            print(yaml.safe_dump(config.redacted(), sort_keys=False), end="")
        return EXIT_OK
    try:
        conn = db.open_spool(config.spool_path, config.spool_pg)
    except (sqlite3.Error, OSError) as e:
        where = str(config.spool_path)
        if config.spool_pg is not None:
            from relay.config.redact import redact_dsn as redact

            where = redact(config.spool_pg.dsn)
        print(f"relay: cannot open the spool at {where}: {e}", file=sys.stderr)
        return EXIT_FAIL
    try:
        return _dispatch(args, conn, config.spool_path)
    except CliError as e:
        print(f"relay: {e}", file=sys.stderr)
        return EXIT_FAIL
    except sqlite3.OperationalError as e:
        print(f"relay: spool busy or unavailable: {e}", file=sys.stderr)
        return EXIT_FAIL
    except BrokenPipeError:  # `relay queue list | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout
        return EXIT_OK
    finally:
        conn.close()


def _act(
    conn: sqlite3.Connection,
    action: str,
    detail: dict[str, Any],
    fn: Callable[[sqlite3.Connection], T],
) -> T:
    """One operator change and its audit record, in one transaction; logged to stderr as an
    `operator_action` line for the journal too."""
    with db.transaction(conn):
        res = fn(conn)
        ops.log_operator(
            conn,
            action,
            {**detail, "result": _audit_result(res)},
            time.time(),
        )
    log_event(log, logging.INFO, "operator_action", action, **detail)
    return res


def _audit_result(res: object) -> Any:
    if isinstance(res, ops.BulkResult):
        return {"messages": len(res.messages), "recipients": res.recipients}
    return res if isinstance(res, int | bool) else None


def _destinations_as_delivered(args: argparse.Namespace, msgs: list[dict[str, Any]]) -> None:
    """The destination a recipient goes through, as logs, stats and `destination list` name
    it: the first upstream of its route (`smarthost` for the classic single one), or its
    domain when the route is MX."""
    for m in msgs:
        for r in m["recipients"]:
            via = _via(args, m, r)
            if via:
                r["destination"] = via[0]


def _via(args: argparse.Namespace, msg: dict[str, Any], rcpt: dict[str, Any]) -> list[str]:
    """The upstreams of the route a recipient takes, in failover order; [] for an MX route
    or without routes (the recipient's own `destination` names it then)."""
    routing = getattr(args, "routing", None)
    if routing is None or not routing.routes:
        return []
    route = routing.match(
        sender=msg.get("sender") or "",
        recipient=rcpt["address"],
        client=msg.get("client") or "",
        listener=msg.get("listener"),
    )
    return [] if route.mx else list(route.via)


def _live_destinations(conn: sqlite3.Connection, now: float) -> dict[str, Any] | None:
    """The daemon's runtime view of its destinations while it is fresh (a stopped
    daemon's is not) and one of them has its circuit open; else None."""
    runtime = ops.get_runtime(conn, "daemon")
    if runtime is None or now - runtime[1] > STALE_AFTER:
        return None
    live: dict[str, Any] = runtime[0].get("destinations", {})
    # only open circuits matter to `_circuit_waits`: none open, nothing to match per row
    return live if any(v.get("circuit") == "open" for v in live.values()) else None


def _circuit_waits(
    args: argparse.Namespace, live: dict[str, Any] | None, msg: dict[str, Any]
) -> None:
    """A waiting recipient with no reason of its own, behind an open circuit: the engine
    does not claim mail for a destination whose circuit is open (nor for a route whose every
    upstream is), so nothing in its row says why it waits. `waiting_on` says it, from the
    daemon's runtime view (`_live_destinations`)."""
    if not live:
        return
    for r in msg["recipients"]:
        if r["state"] not in WAITING or r.get("reason"):
            continue
        names = _via(args, msg, r) or [r["destination"]]
        views = [live.get(n) or {} for n in names]
        if names and all(v.get("circuit") == "open" for v in views):
            until = max(str(v.get("circuit_reopens_at") or "") for v in views)
            r["waiting_on"] = f"circuit open for {', '.join(names)}" + (
                f" until {until}" if until else ""
            )


def _queued_by_destination(args: argparse.Namespace, conn: sqlite3.Connection) -> dict[str, int]:
    """Unfinished recipients per destination as delivery names it: counted in SQL without
    routes; with routes, each recipient's route is matched while the rows stream by."""
    routing = getattr(args, "routing", None)
    if routing is None or not routing.routes:
        return ops.waiting_per_destination(conn)
    out: dict[str, int] = {}
    for dest, address, sender, client, listener in ops.waiting_recipients(conn):
        route = routing.match(sender=sender, recipient=address, client=client, listener=listener)
        if not route.mx:
            dest = route.via[0]
        out[dest] = out.get(dest, 0) + 1
    return out


def _bulk_options(p: argparse.ArgumentParser) -> None:
    """postsuper-style bulk selection: `--all` with optional filters, `--dry-run`."""
    p.add_argument(
        "--all",
        action="store_true",
        help="every message matching the filters (like postsuper -d ALL)",
    )
    p.add_argument(
        "--state",
        choices=_MSG_STATES,
        help="with --all: messages in this state",
    )
    p.add_argument("--domain", help="with --all: a recipient at this domain")
    p.add_argument("--recipient", help="with --all: this recipient")
    p.add_argument("--older-than", help="with --all: older than this (e.g. 1h)")
    p.add_argument("--dry-run", action="store_true", help="only say how many would change")


def _select(args: argparse.Namespace, conn: sqlite3.Connection, now: float) -> list[str]:
    """The message ids a bulk command (`--all` + filters) acts on."""
    older = parse_duration(args.older_than, "--older-than") if args.older_than else None
    msgs = ops.iter_messages(  # a page at a time: only the ids are kept
        conn,
        state=args.state,
        include_finished=args.qcmd == "delete",
        recipient=args.recipient,
        domain=args.domain,
        older_than=older,
        now=now,
    )
    return [m["id"] for m in msgs]


def _dispatch(args: argparse.Namespace, conn: sqlite3.Connection, spool: Any) -> int:
    now = time.time()
    if args.cmd == "stats":
        return _stats(args, conn, now)
    if args.cmd == "fleet":
        return _fleet(args, conn, now)
    if args.cmd == "feedback":
        return _feedback(args, conn)
    if args.cmd == "alerts":
        from relay.ops.alerts import recent

        rows = recent(conn, max(1, args.limit))
        if args.json:
            _print_json(rows)
        else:
            for a in rows:
                state = (
                    "sent"
                    if a["sent_at"]
                    else (
                        f"pending {','.join(a['pending_sinks'])}"
                        + (f" ({printable(a['last_error'])})" if a["last_error"] else "")
                    )
                )
                print(
                    f"{a['last_at']} {a['severity']:<8} {a['event']:<20} x{a['count']:<4}"
                    f" {printable(a['summary'])}  [{state}]"
                )
        return EXIT_OK
    if args.cmd == "queue":
        return _queue(args, conn, spool, now)
    if args.cmd == "suppression":
        return _suppression(args, conn, now)
    if args.cmd == "destination":
        return _destination(args, conn, now)
    return EXIT_USAGE


# --- queue ------------------------------------------------------------------------------


def _queue(args: argparse.Namespace, conn: sqlite3.Connection, spool: Any, now: float) -> int:
    verb = _QUEUE_VERBS.get(args.qcmd, _queue_bulk)  # the rest: delete, hold, release, ...
    return verb(args, conn, spool, now)


def _queue_list(args: argparse.Namespace, conn: sqlite3.Connection, spool: Any, now: float) -> int:
    """`queue list`: the maildrop's waiting files first, then the spool a page at a time."""
    older = parse_duration(args.older_than, "--older-than") if args.older_than else None
    if args.limit is not None and args.limit < 1:
        print("relay: --limit takes a whole number of at least 1", file=sys.stderr)
        return EXIT_USAGE
    drops = _maildrop_rows(args, now, older) if args.state in (None, "maildrop") else []
    if args.limit is not None:
        drops = drops[: args.limit]
    listed = (
        ops.iter_messages(
            conn,
            state=args.state,
            include_finished=args.all,
            recipient=args.recipient,
            domain=args.domain,
            older_than=older,
            now=now,
            limit=None if args.limit is None else args.limit - len(drops),
        )
        if args.state != "maildrop" and (args.limit is None or args.limit > len(drops))
        else iter(())
    )

    live = _live_destinations(conn, now)

    def shown() -> Iterator[dict[str, Any]]:
        yield from drops  # waiting for the daemon: older than anything it queued since
        for m in listed:  # a page at a time: the first lines come at once
            _destinations_as_delivered(args, [m])
            _circuit_waits(args, live, m)
            yield m

    if args.json:
        _stream_json_array(shown())
    else:
        _print_mailq(shown())
    return EXIT_OK


def _queue_find(args: argparse.Namespace, conn: sqlite3.Connection, spool: Any, now: float) -> int:
    """`queue find`: by Message-ID, upstream id or recipient, finished messages too."""
    if not (args.message_id or args.upstream_id or args.recipient):
        print(
            "relay: queue find: give --message-id, --upstream-id or --recipient",
            file=sys.stderr,
        )
        return EXIT_USAGE
    msgs = ops.list_messages(
        conn,
        include_finished=True,
        recipient=args.recipient,
        message_id=normalize_message_id(args.message_id) if args.message_id else None,
        upstream_id=args.upstream_id.strip().strip("<>") if args.upstream_id else None,
        now=now,
    )
    _destinations_as_delivered(args, msgs)
    if args.json:
        _print_json(msgs)
    elif msgs:
        _print_mailq(msgs)
    else:
        print("relay: no message matches", file=sys.stderr)
    return EXIT_OK if msgs else EXIT_FAIL


def _queue_show(args: argparse.Namespace, conn: sqlite3.Connection, spool: Any, now: float) -> int:
    """`queue show ID`: one message, its recipients, headers (and `--body`)."""
    msg = ops.show_message(conn, args.id)
    if msg is None:
        raise CliError(f"no such message: {args.id}")
    _destinations_as_delivered(args, [msg])
    _circuit_waits(args, _live_destinations(conn, now), msg)
    raw, path = ops.message_body(conn, args.id)
    data = bodies.load(spool, raw, path)
    head, _sep, body = data.partition(b"\r\n\r\n")
    if args.body and args.raw and not args.json:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        return EXIT_OK
    msg["headers"] = head.decode("utf-8", errors="replace")
    if args.body:
        msg["body"] = body.decode("utf-8", errors="surrogateescape" if not args.json else "replace")
    if args.json:
        _print_json(msg)
    else:
        _print_show(msg)
    return EXIT_OK


def _queue_summary(
    args: argparse.Namespace, conn: sqlite3.Connection, spool: Any, now: float
) -> int:
    return _summary(args, conn, now)


def _queue_purge(args: argparse.Namespace, conn: sqlite3.Connection, spool: Any, now: float) -> int:
    """`queue purge --older-than`: finished messages deleted (data minimisation)."""
    try:
        age = parse_duration(args.older_than, "--older-than")
    except ConfigError as e:
        print(f"relay: {e}", file=sys.stderr)
        return EXIT_USAGE
    # data minimisation: bodies hold reset links and one-time codes
    found = ops.finished_before(conn, now - age)
    if not args.dry_run and found:
        paths = _act(
            conn,
            "purge",
            {"older_than": args.older_than, "messages": len(found)},
            lambda x: ops.delete_messages(x, found),
        )
        bodies.delete_bodies(spool, paths)
    if args.json:
        _print_json({"action": "purge", "dry_run": args.dry_run, "messages": len(found)})
    else:
        verb = "would delete" if args.dry_run else "deleted"
        print(f"purge: {verb} {len(found)} finished message{'' if len(found) == 1 else 's'}")
    return EXIT_OK


def _queue_bulk(args: argparse.Namespace, conn: sqlite3.Connection, spool: Any, now: float) -> int:
    """`queue delete|hold|release|retry|flush`: by IDs, by filters with --all, or (flush,
    retry --failed) everything that qualifies; one audited operator action."""
    c = args.qcmd
    ids: list[str] = list(getattr(args, "ids", []) or [])
    dry = bool(getattr(args, "dry_run", False))
    filters = [f for f in ("state", "domain", "recipient", "older_than") if getattr(args, f, None)]
    target: list[str] | None = ids
    if c == "flush":
        target = None
    elif getattr(args, "all", False):
        if ids:
            print(f"relay: queue {c}: --all selects with filters; give it no IDs", file=sys.stderr)
            return EXIT_USAGE
        try:
            target = _select(args, conn, now)
        except ConfigError as e:
            print(f"relay: {e}", file=sys.stderr)
            return EXIT_USAGE
    elif filters:
        print(f"relay: queue {c}: filters go with --all", file=sys.stderr)
        return EXIT_USAGE
    elif c in ("delete", "hold", "release") and not ids:
        print(f"relay: queue {c} needs IDs or --all", file=sys.stderr)
        return EXIT_USAGE
    elif c == "retry" and not ids:
        if not args.failed:
            print("relay: queue retry needs IDs, --failed or --all", file=sys.stderr)
            return EXIT_USAGE
        target = None  # --failed: every dead letter
    if target is ids:
        missing = [i for i in ids if i not in ops.existing_ids(conn, ids)]
        if missing:
            raise CliError(f"no such message: {', '.join(missing)}")
    failed = bool(getattr(args, "failed", False))
    if c == "retry":
        for qid, addr, reason in ops.suppressed_recipients(conn, target, failed):
            print(
                f"relay: {qid}: {printable(addr)} is on the suppression list"
                f" ({printable(reason)}) and is not retried; lift it with"
                f" `relay suppression remove {printable(addr)}` and retry again",
                file=sys.stderr,
            )

    def run(x: sqlite3.Connection) -> ops.BulkResult:
        if c == "flush" and not dry:
            ops.engine_command(x, "kick", "*", now)  # through an open circuit, at once
        # --domain/--recipient select recipients, never the other recipients of the same
        # message; the dry run is this same statement as a SELECT (ops.bulk)
        return ops.bulk(
            x,
            c,
            target,
            now,
            recipient=getattr(args, "recipient", None),
            domain=getattr(args, "domain", None),
            failed_only=failed,
            dry_run=dry,
        )

    if dry:
        res = run(conn)
    else:
        detail: dict[str, Any] = {} if target is None else {"ids": target}
        if c == "retry":
            detail["failed"] = failed
        detail.update({f: getattr(args, f) for f in filters})
        res = _act(conn, c, detail, run)
        bodies.delete_bodies(spool, list(res.paths))
    return _done(args, c, res, dry)


_QUEUE_VERBS: dict[str, Callable[[argparse.Namespace, sqlite3.Connection, Any, float], int]] = {
    "list": _queue_list,
    "find": _queue_find,
    "show": _queue_show,
    "summary": _queue_summary,
    "purge": _queue_purge,
}


def _maildrop_rows(
    args: argparse.Namespace, now: float, older: float | None
) -> list[dict[str, Any]]:
    """relay-sendmail's files in the maildrop (relay/spool/maildrop.py), as `queue list` rows:
    state `maildrop`, id = the file name, the same JSON fields as a queued message."""
    from relay.spool import maildrop

    try:
        rows = maildrop.entries(args.maildrop)
    except OSError as e:
        print(
            f"relay: cannot list the maildrop {args.maildrop}: {e.strerror or e}"
            " (run as the daemon's user to see it)",
            file=sys.stderr,
        )
        return []
    out = []
    for row in rows:
        created = float(row["created_at"])
        addrs = [str(r["address"]).lower() for r in row["recipients"]]
        if older is not None and created > now - older:
            continue
        if args.recipient and args.recipient.strip().strip("<>").lower() not in addrs:
            continue
        if args.domain and not any(a.rpartition("@")[2] == args.domain.lower() for a in addrs):
            continue
        out.append({**row, "created_at": ops.iso_utc(created)})
    return out


def _done(args: argparse.Namespace, action: str, res: ops.BulkResult, dry: bool) -> int:
    """Every bulk action's answer: the messages and the recipients it changed (or, dry,
    would change: the same counts the real run then reports)."""
    m, n = len(res.messages), res.recipients
    if args.json:
        doc: dict[str, Any] = {
            "action": action,
            "dry_run": dry,
            "ids": list(res.messages),
            "messages": m,
            "recipients": n,
            "recipients_changed": n,  # the name before `recipients`, kept for scripts
        }
        if action == "delete":
            doc["messages_removed"] = res.removed
        if action in ("hold", "release"):  # recipients in their attempt: marked / unmarked
            doc["after_attempt"] = res.after_attempt
        _print_json(doc)
        return EXIT_OK
    what = f"{n} recipient{'' if n == 1 else 's'} of {m} message{'' if m == 1 else 's'}"
    if dry:
        line = f"{action}: would {'delete' if action == 'delete' else 'change'} {what}"
    else:
        line = f"{action}: {what} {'deleted' if action == 'delete' else 'changed'}"
    if action == "delete":
        k = res.removed
        gone = "would be" if dry else ("was" if k == 1 else "were")
        line += f" ({k} message{'' if k == 1 else 's'} left with no recipient {gone} removed)"
    line += _after_attempt_text(action, res.after_attempt, dry)
    print(line)
    return EXIT_OK


def _after_attempt_text(action: str, n: int, dry: bool) -> str:
    """What a hold did to recipients in their attempt (relay/spool/model.py): they cannot
    be taken out of it, so they are held when it ends undelivered; a release unmarks them."""
    if not n or action not in ("hold", "release"):
        return ""
    who = f"{n} recipient{'' if n == 1 else 's'} in an attempt now"
    if action == "hold":
        return f"; {who} {'would be' if dry else 'will be'} held when it ends, unless it delivers"
    return f"; {who} {'would' if dry else 'will'} no longer be held when it ends"


AGE_BUCKETS = [
    (300, "5m"),
    (3600, "1h"),
    (4 * 3600, "4h"),
    (86400, "1d"),
    (3 * 86400, "3d"),
    (float("inf"), "older"),
]


def _summary(args: argparse.Namespace, conn: sqlite3.Connection, now: float) -> int:
    # by recipient domain, like qshape (`destination list` counts by upstream)
    table = ops.waiting_by_age(conn, now, [lim for lim, _l in AGE_BUCKETS])
    if args.json:
        _print_json(
            {
                "buckets": [label for _l, label in AGE_BUCKETS],
                "destinations": {
                    d: {"total": sum(v), "by_age": v} for d, v in sorted(table.items())
                },
            }
        )
        return EXIT_OK
    labels = [label for _l, label in AGE_BUCKETS]
    print(f"{'destination':<32} {'total':>6} " + " ".join(f"{lb:>6}" for lb in labels))
    totals = [0] * len(AGE_BUCKETS)
    for d, v in sorted(table.items(), key=lambda kv: -sum(kv[1])):
        totals = [a + b for a, b in zip(totals, v, strict=True)]
        print(f"{d[:32]:<32} {sum(v):>6} " + " ".join(f"{x:>6}" for x in v))
    print(f"{'TOTAL':<32} {sum(totals):>6} " + " ".join(f"{x:>6}" for x in totals))
    return EXIT_OK


# --- feedback ---------------------------------------------------------------------------


def _feedback(args: argparse.Namespace, conn: sqlite3.Connection) -> int:
    if args.fcmd == "purge":
        return _feedback_purge(args, conn)
    if args.fcmd == "show":
        data = ops.feedback_mail_body(conn, args.id)
        if data is None:
            raise CliError(f"no such feedback mail: {args.id}")
        if args.raw:  # the operator asked for the sender's bytes: a file, a parser
            sys.stdout.flush()
            sys.stdout.buffer.write(data)
            return EXIT_OK
        # an outsider wrote this mail: ESC, OSC 8 links, bidi overrides never reach the
        # terminal raw (printable), a line at a time
        _print_escaped(data)
        return EXIT_OK
    if args.fcmd == "events":
        rows = ops.feedback_events(conn, max(1, args.limit))
    else:
        rows = ops.feedback_mail(conn, max(1, args.limit), unread=args.unread)
    for r in rows:
        r["at"] = _iso(r["at"])
    if args.json:
        _print_json(rows)
        return EXIT_OK
    for r in rows:
        if args.fcmd == "events":
            print(
                f"{r['at']}  {r['provider']:<9} {r['type']:<12} {printable(r['recipient']):<36}"
                f" {r['outcome']:<11} {r['msg_id'] or '-'}  {printable(r['reason'] or '')[:80]}"
            )
        else:
            what = f"{r['events']} event(s)" if r["error"] is None else f"UNREAD: {r['error']}"
            size = f"{r['size']} bytes" + (f", stored {r['stored']}" if r["truncated"] else "")
            print(
                f"{r['id']:>6}  {r['at']}  from {printable(r['sender'] or '<>')}"
                f" ({size})  {printable(what)[:120]}"
            )
    print(f"-- {len(rows)} {'event' if args.fcmd == 'events' else 'message'}(s)")
    return EXIT_OK


def _feedback_purge(args: argparse.Namespace, conn: sqlite3.Connection) -> int:
    """`relay feedback purge --older-than DUR | --all`: stored feedback mail deleted."""
    from relay.feedback import storage

    before: float | None = None
    if not args.all:
        try:
            before = time.time() - parse_duration(args.older_than, "--older-than")
        except ConfigError as e:
            print(f"relay: {e}", file=sys.stderr)
            return EXIT_USAGE
    detail = {"all": True} if args.all else {"older_than": args.older_than}
    mails, octets = _act(conn, "feedback purge", detail, lambda x: storage.purge(x, before))
    if args.json:
        _print_json({"action": "feedback purge", "mails": mails, "bytes": octets, **detail})
    else:
        print(f"feedback purge: deleted {mails} mail{'' if mails == 1 else 's'} ({octets} bytes)")
    return EXIT_OK


# --- suppression, destinations, stats ---------------------------------------------------


def _suppression(args: argparse.Namespace, conn: sqlite3.Connection, now: float) -> int:
    if args.scmd == "list":
        rows = ops.suppression_list(conn)
        for r in rows:
            r["created_at"] = _iso(r["created_at"])
        if args.json:
            _print_json(rows)
        else:
            for r in rows:
                # printable(): an address or reason spooled before addresses were checked
                # may hold control characters; never write them raw to a terminal.
                print(
                    f"{printable(r['address']):<40} {printable(r['scope']):<20}"
                    f" {r['created_at']}  {printable(r['reason'] or '')}"
                )
            print(f"-- {len(rows)} suppressed address{'es' if len(rows) != 1 else ''}")
        return EXIT_OK
    addr = args.address.strip().strip("<>")
    try:
        check_mailbox(addr)
    except AddressError as e:
        print(f"relay: '{printable(args.address)}' is not an email address: {e}", file=sys.stderr)
        return EXIT_USAGE
    scope = args.scope
    stored = None if scope is None else ("" if scope.lower() == "global" else scope.lower())
    detail = {"address": addr} if scope is None else {"address": addr, "scope": scope}
    if args.scmd == "add":
        assert stored is not None
        ok = _act(
            conn,
            "suppression_add",
            detail,
            lambda x: ops.suppression_add(x, addr, args.reason, now, stored),
        )
    else:
        ok = _act(
            conn,
            "suppression_remove",
            detail,
            lambda x: ops.suppression_remove(x, addr, stored),
        )
    if args.json:
        doc = {"action": args.scmd, "address": addr, "changed": ok}
        if scope is not None:
            doc["scope"] = scope
        _print_json(doc)
    elif ok:
        shown = scope is not None and scope.lower() != "global"
        print(f"{args.scmd}: {addr}" + (f" (scope {scope})" if shown else ""))
    if not ok:
        where = "" if scope is None else f" (scope {scope})"
        print(f"relay: {addr} is not on the suppression list{where}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def _destination(args: argparse.Namespace, conn: sqlite3.Connection, now: float) -> int:
    if args.dcmd == "list":
        runtime = ops.get_runtime(conn, "daemon")
        live = runtime[0].get("destinations", {}) if runtime else {}
        susp = ops.suspensions(conn, now)
        queued = _queued_by_destination(args, conn)
        names = set(live) | set(susp) | set(queued)
        out = []
        for n in sorted(names):
            info = dict(live.get(n, {}))
            info["name"] = n
            info["queued_recipients"] = queued.get(n, 0)
            if n in susp:
                info["suspended_until"] = _iso(susp[n][0])
                info["suspend_reason"] = f"operator: {susp[n][1]}"
            elif str(info.get("suspend_reason") or "").startswith("operator"):
                # resumed since the daemon's last snapshot: the spool has the last word
                info["suspended_until"] = info["suspend_reason"] = None
            out.append(info)
        if args.json:
            _print_json(out)
        else:
            print(
                f"{'destination':<28} {'upstream':<30} {'queued':>7} {'rate/s':>8} {'conns':>6} "
                f"{'circuit':<12} {'today':>7} {'limit':>7}  suspended"
            )
            for i in out:
                rate = i.get("effective_rate")
                # an upstream that refused our configuration (AUTH, TLS) takes no mail
                # although its circuit is closed: say so, and why, instead of `closed`
                err = i.get("config_error")
                circuit = "CONFIG-ERROR" if err else str(i.get("circuit", "-"))
                print(
                    f"{i['name'][:28]:<28} {printable(str(i.get('upstream') or '-'))[:30]:<30} "
                    f"{i['queued_recipients']:>7} "
                    f"{'-' if rate is None else f'{rate:.2f}':>8} "
                    f"{i.get('effective_connections', '-')!s:>6} "
                    f"{circuit:<12} {i.get('delivered_today', 0)!s:>7} "
                    f"{i.get('daily_limit') or '-'!s:>7}  "
                    f"{i.get('suspended_until') or ''}"
                )
                if err:
                    print(
                        f"  config error: {printable(str(err))} (fix the configuration, then"
                        f" `relay destination reset {i['name']}`)"
                    )
        return EXIT_OK
    name = args.name.lower()
    if args.dcmd == "suspend":
        seconds = parse_duration(args.duration, "--for")
        until = now + seconds
        _act(
            conn,
            "destination_suspend",
            {"name": name, "until": until},
            lambda x: ops.suspend_destination(x, name, until, args.reason),
        )
        if args.json:
            _print_json({"action": "suspend", "name": name, "until": _iso(until)})
        else:
            print(f"suspended {name} until {_iso(until)}")
        return EXIT_OK
    if args.dcmd == "reset":
        n = _act(
            conn, "destination_reset", {"name": name}, lambda x: ops.reset_destination(x, name, now)
        )
        if args.json:
            _print_json({"action": "reset", "name": name, "recipients_due_now": n})
        else:
            print(
                f"reset {name}: circuit closed and slow-down cleared (the daemon acts within"
                f" a second); {n} recipients that waited for the circuit are due now"
            )
        return EXIT_OK

    def resume(x: sqlite3.Connection) -> int:
        ops.engine_command(x, "kick", name, now)
        return ops.resume_destination(x, name, now)

    n = _act(conn, "destination_resume", {"name": name}, resume)
    if args.json:
        _print_json({"action": "resume", "name": name, "recipients_due_now": n})
    else:
        print(f"resumed {name}; {n} deferred recipients due now")
    return EXIT_OK


def _stats(args: argparse.Namespace, conn: sqlite3.Connection, now: float) -> int:
    st = ops.stats(conn, now)
    runtime = ops.get_runtime(conn, "daemon")
    nodes = ops.list_nodes(conn, now, args.lease)
    if runtime is not None:
        live, updated = runtime
        if live.get("host", socket.gethostname()) == socket.gethostname():
            running = _alive(live.get("pid"))
        else:  # a node of the fleet on another machine: its heartbeat says
            running = any(n["node"] == live.get("node") and n["alive"] for n in nodes)
        st["daemon"] = {
            **live,
            "snapshot_age_seconds": round(now - updated, 1),
            "running": running and now - updated < STALE_AFTER,
        }
    else:
        st["daemon"] = None
    st["fleet"] = nodes
    from relay.feedback.apply import rates as feedback_rates  # only stats reads them

    st["feedback"] = feedback_rates(conn, now)
    if args.json:
        _print_json(st)
        return EXIT_OK
    r = st["recipients"]
    print(f"messages in spool: {st['messages']}")
    print("recipients: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    age = st["oldest_queued_age"]
    print(f"oldest unfinished: {'-' if age is None else f'{age:.0f}s'}")
    print(f"suppressed addresses: {st['suppressed_addresses']}, dedup keys: {st['dedup_keys']}")
    d = st["daemon"]
    if d and not d["running"]:
        print(
            f"daemon: NOT RUNNING (pid {d.get('pid')} gone or silent; the last snapshot"
            f" is {d['snapshot_age_seconds']:.0f}s old and shown below as it was)"
        )
    if d:
        print(
            f"daemon pid {d.get('pid')} (snapshot {d['snapshot_age_seconds']}s old),"
            f" in flight {d.get('inflight')}"
        )
        for name, info in sorted(d.get("destinations", {}).items()):
            lim = info.get("daily_limit")
            print(
                f"  {name}: rate {info.get('effective_rate') or 'unlimited'}"
                f" (configured {info.get('configured_rate') or 'unlimited'}),"
                f" connections {info.get('effective_connections')}/"
                f"{info.get('max_connections')}, circuit {info.get('circuit')},"
                f" today {info.get('delivered_today')}"
                f"{f'/{lim}' if lim is not None else ''}"
            )
        for name, info in sorted(d.get("identities", {}).items()):
            print(
                f"  identity {name}: today {info['today']}"
                f"/{info['limit'] if info['limit'] is not None else 'unlimited'}"
            )
    else:
        print("daemon: no snapshot (not running yet?)")
    if len(nodes) > 1 or any(n.get("node") != (d or {}).get("node") for n in nodes):
        _print_nodes(nodes)
    if st["feedback"]:
        print("feedback per identity (24h | 7d): delivered, bounces, complaints")
    for f in st["feedback"]:
        parts = []
        for span in ("24h", "7d"):
            x = f[span]
            parts.append(
                f"{x['delivered']}, {x['bounced']} ({_pct(x['bounce_rate'])}),"
                f" {x['complained']} ({_pct(x['complaint_rate'])})"
            )
        worst = f["24h"]["complaint_rate"] or 0.0
        flag = "  COMPLAINTS OVER 0.3%" if worst > COMPLAINT_LIMIT else ""
        print(f"  identity {printable(str(f['identity']))}: {' | '.join(parts)}{flag}")
    return EXIT_OK


COMPLAINT_LIMIT = 0.003  # Gmail's and Yahoo's bulk-sender ceiling (2024)


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.2f}%"


# --- printing -----------------------------------------------------------------------------


def _iso(ts: float | None) -> str | None:
    return None if ts is None else ops.iso_utc(ts)


_NON_ASCII = re.compile("[^\x00-\x7e]")  # one character at a time: linear


def _json_char(m: re.Match[str]) -> str:
    ch = m[0]
    if printable(ch) == ch:
        return ch
    o = ord(ch)
    if o > 0xFFFF:  # JSON spells an astral character as its UTF-16 surrogate pair
        o -= 0x10000
        return f"\\u{0xD800 + (o >> 10):04x}\\u{0xDC00 + (o & 0x3FF):04x}"
    return f"\\u{o:04x}"


def _json_text(obj: Any) -> str:
    """JSON with the text readable (ensure_ascii=False) but terminal-safe: json.dumps
    escapes C0 controls itself; DEL, C1 controls (0x9B is a CSI), bidi and zero-width
    characters and undecodable bytes are escaped here too (the same string to a parser)."""
    return _NON_ASCII.sub(_json_char, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False))


def _print_json(obj: Any) -> None:
    print(_json_text(obj))


def _print_mailq(msgs: Iterable[dict[str, Any]]) -> None:
    """postqueue -p's layout, printed as the messages come (a page at a time)."""
    total = count = 0
    for m in msgs:
        if not count:
            print(
                f"{'-Queue ID-':<18} {'-State-':<9} {'--Size--':>8} {'----Arrival Time----':<21}"
                f" -Sender/Recipient-------"
            )
        count += 1
        total += m["size"]
        print(
            f"{m['id']:<18} {m['state']:<9} {m['size']:>8} {m['created_at']:<21}"
            f" {printable(m['sender'] or '<>')}"
        )
        for r in m["recipients"]:
            if r["last_reply"] and r["state"] != RcptState.DELIVERED:
                print(f"{'':<59}({printable(r['last_reply'][:100])})")
            if r.get("waiting_on"):  # Postfix: "(delivery temporarily suspended: ...)"
                print(f"{'':<59}(waiting: {r['waiting_on']})")
            print(f"{'':<59}{printable(r['address'])} [{r['state']}]")
        print()
    if not count:
        print("Mail queue is empty")
        return
    print(f"-- {total // 1024} Kbytes in {count} Request{'s' if count != 1 else ''}.")


def _stream_json_array(items: Iterable[Any]) -> None:
    """A JSON array written item by item (the same text `_print_json` gives a list), so
    memory does not grow with the spool."""
    out = sys.stdout
    first = True
    for item in items:
        text = _json_text(item)
        out.write(("[\n" if first else ",\n") + "  " + text.replace("\n", "\n  "))
        first = False
    out.write("[]\n" if first else "\n]\n")


def _print_show(msg: dict[str, Any]) -> None:
    for k in (
        "id",
        "state",
        "message_id",
        "sender",
        "size",
        "created_at",
        "lane",
        "identity",
        "client",
        "peer",
        "next_attempt_at",
    ):
        value = msg.get(k)
        print(f"{k + ':':<17}{'-' if value is None else printable(str(value))}")
    print("recipients:")
    for r in msg["recipients"]:
        print(
            f"  {printable(r['address'])}  {r['state']}  attempts={r['attempts']}"
            f"  next={r['next_attempt_at'] or '-'}"
        )
        if r["last_reply"]:
            print(f"      last reply: {printable(r['last_reply'])}")
        if r.get("hold_after_attempt"):
            print("      held when this attempt ends, unless it delivers (relay queue hold)")
        if r.get("upstream_id"):
            print(f"      upstream id: {printable(r['upstream_id'])}")
        if r.get("reason"):
            print(f"      waiting: {printable(r['reason'])}")
        elif r.get("waiting_on"):
            print(f"      waiting: {r['waiting_on']}")
    print("attempt log:")
    for a in msg["attempt_log"]:
        print(
            f"  {a['at']}  {printable(a['recipient'])}  {a['outcome']}"
            f"  {printable(a['host'] or '-')}  {printable(a['reply'] or '')}"
        )
    print("headers:")
    # split at CRLF only (what ends a header line); a folded header's TAB is shown as the
    # indentation it is, every other control character escaped
    for line in msg["headers"].split("\r\n"):
        print("  " + printable(line, keep="\t"))
    if "body" in msg:
        print("body:")
        _print_escaped(msg["body"].encode("utf-8", "surrogateescape"))


def _print_escaped(data: bytes) -> None:
    """Stored mail for a terminal: line by line (CRLF or LF), TAB kept, every other control
    character, invalid byte and invisible character escaped (printable)."""
    text = data.decode("utf-8", "surrogateescape")
    for line in text.split("\n"):
        print(printable(line.removesuffix("\r"), keep="\t"))
