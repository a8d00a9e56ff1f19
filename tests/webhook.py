"""A real HTTP receiver on loopback for the alert webhook: records every POST (headers and
body), answers with a status the test sets, and can be started late (on a port reserved
before) to play a receiver that is down."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.harness import free_port


@dataclass
class Post:
    headers: dict[str, str]
    body: bytes
    status: int  # what we answered

    @property
    def form(self) -> dict[str, str]:
        from urllib.parse import parse_qsl

        return dict(parse_qsl(self.body.decode()))

    @property
    def doc(self) -> dict[str, Any]:
        return dict(json.loads(self.body))

    def signed_by(self, secret: bytes) -> bool:
        want = "sha256=" + hmac.new(secret, self.body, hashlib.sha256).hexdigest()
        return hmac.compare_digest(want, self.headers.get("x-relay-signature", ""))


@dataclass
class Receiver:
    port: int = field(default_factory=free_port)
    status: int = 200
    # a JSON endpoint instead (an OAuth2 token endpoint): post -> (status, document)
    answer: Callable[[Post], tuple[int, dict[str, Any]]] | None = None
    posts: list[Post] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(n)
                post = Post({k.lower(): v for k, v in self.headers.items()}, body, rec.status)
                out = b""
                if rec.answer is not None:
                    post.status, doc = rec.answer(post)
                    out = json.dumps(doc).encode()
                with rec._cond:
                    rec.posts.append(post)
                    rec._cond.notify_all()
                self.send_response(post.status)
                self.send_header("Content-Length", str(len(out)))
                if out:
                    self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def accepted(self) -> list[Post]:
        """The posts we answered 2xx: what the relay counts as delivered."""
        with self._cond:
            return [p for p in self.posts if 200 <= p.status < 300]

    def wait(
        self, pred: Callable[[list[Post]], bool], timeout: float = 30.0, what: str = "webhook posts"
    ) -> list[Post]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not pred(self.accepted()):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"timed out waiting for {what}; got {[p.doc for p in self.posts]}"
                    )
                self._cond.wait(min(left, 0.2))
            return self.accepted()
