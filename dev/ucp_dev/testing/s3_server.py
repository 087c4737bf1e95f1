"""A real S3-compatible server on this machine, for the tests, ``make s3-demo`` and ``recipes/bench_s3.py``:
moto's S3 (from PyPI, ``ucp-dcp[s3]``) served over HTTP on 127.0.0.1, with faults a test can switch on.

Clients reach it through the usual AWS configuration (:meth:`S3Server.env`: ``AWS_ENDPOINT_URL``,
dummy credentials), exactly as they would reach a store elsewhere; nothing leaves the machine.

:class:`Faults` are applied in front of moto, per request, to what a real store does under stress or
misconfiguration: a write ``AccessDenied`` (403) by a bucket policy, ``SlowDown`` (503) while it
throttles, and a listing that does not show objects written a moment ago. It also counts requests and
the object bytes served, so tests measure what a load fetched at the server, not what the client says.

Run on its own (the benchmark keeps it out of the ranks' processes): ``python -m ucp_dev.testing.s3_server
--bucket ucp`` prints ``READY <endpoint>`` and serves until killed; :func:`server_stats` reads its counters
from another process.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Faults", "S3Server", "create_bucket", "server_stats", "spawn_server", "main"]

_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'
)
_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
STATS_PATH = "/__ucp_server_stats__"
"""Not a bucket name S3 allows: ``GET`` returns the counters as JSON, ``DELETE`` returns and resets them."""
_CONTENTS = re.compile(rb"<Contents>.*?</Contents>", re.S)
_KEY = re.compile(rb"<Key>(.*?)</Key>", re.S)


@dataclass
class Faults:
    """What the server does to requests besides serving them (all off by default)."""

    deny: list[tuple[str, str]] = field(default_factory=list)
    """``(HTTP method, regex on the key)``: answered 403 AccessDenied (a write-denying bucket policy)."""
    throttle: list[list[Any]] = field(default_factory=list)
    """``[method, key regex, count]``: the next ``count`` matching requests answered 503 SlowDown
    (``count`` < 0: every one)."""
    hide: list[str] = field(default_factory=list)
    """Regexes on keys that listings leave out (a listing not yet showing fresh objects)."""
    requests: Counter = field(default_factory=Counter)
    """Requests served, by ``"METHOD kind"`` (kind: ``object``, ``bucket``)."""
    bytes_out: Counter = field(default_factory=Counter)
    """Object bytes sent: ``GET`` (all reads), ``GET data`` (of ``.distcp`` objects), ``GET other``."""
    refused: Counter = field(default_factory=Counter)
    """Requests answered by a fault, by ``"403"`` / ``"503"``."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def clear(self) -> None:
        """Switch every fault off and reset the counters."""
        with self.lock:
            self.deny.clear()
            self.throttle.clear()
            self.hide.clear()
            self.requests.clear()
            self.bytes_out.clear()
            self.refused.clear()


class _Middleware:
    """WSGI app in front of moto's: applies :class:`Faults`, counts, filters listings."""

    def __init__(self, app: Any, faults: Faults) -> None:
        self.app, self.faults = app, faults

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        method = environ["REQUEST_METHOD"]
        if environ.get("PATH_INFO") == STATS_PATH:  # the counters, for a driver in another process
            return self._stats(method, start_response)
        parts = environ.get("PATH_INFO", "/").lstrip("/").split("/", 1)
        key = parts[1] if len(parts) > 1 else ""
        f = self.faults
        with f.lock:
            f.requests[f"{method} {'object' if key else 'bucket'}"] += 1
            if key and any(m == method and re.search(rx, key) for m, rx in f.deny):
                f.refused["403"] += 1
                return self._error(start_response, "403 Forbidden", _DENIED)
            for rule in f.throttle:
                if rule[0] == method and re.search(rule[1], key) and rule[2] != 0:
                    rule[2] -= 1 if rule[2] > 0 else 0
                    f.refused["503"] += 1
                    return self._error(start_response, "503 Slow Down", _SLOWDOWN)
            hide = list(f.hide)
        listing = method == "GET" and not key and "uploads" not in environ.get("QUERY_STRING", "")
        captured: dict[str, Any] = {}

        def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            captured["status"], captured["headers"] = status, headers
            return lambda _data: None

        body = b"".join(self.app(environ, capture))
        headers = captured["headers"]
        if listing and hide:
            body = _CONTENTS.sub(lambda m: b"" if _hidden(m.group(0), hide) else m.group(0), body)
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(len(body))))
        if method == "GET" and key:
            with f.lock:
                f.bytes_out["GET"] += len(body)
                f.bytes_out["GET data" if key.endswith(".distcp") else "GET other"] += len(body)
        start_response(captured["status"], headers)
        return [body]

    def _stats(self, method: str, start_response: Any) -> list[bytes]:
        """``GET``: the request and byte counters as JSON (then reset them with ``DELETE``)."""
        import json

        f = self.faults
        with f.lock:
            body = json.dumps({"requests": dict(f.requests), "bytes_out": dict(f.bytes_out)}).encode()
            if method == "DELETE":
                f.requests.clear()
                f.bytes_out.clear()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    @staticmethod
    def _error(start_response: Any, status: str, body: bytes) -> list[bytes]:
        start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
        return [body]


def _hidden(contents: bytes, hide: list[str]) -> bool:
    m = _KEY.search(contents)
    return bool(m) and any(re.search(rx, m.group(1).decode()) for rx in hide)


class S3Server:
    """moto's S3 on ``127.0.0.1:port`` (0: a free port) in a thread of this process, with :class:`Faults`."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.faults = Faults()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> S3Server:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
        app = _Middleware(DomainDispatcherApplication(create_backend_app), self.faults)
        self._server = make_server("127.0.0.1", self.port, app, threaded=True, request_handler=MotoRequestHandler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="s3-server")
        self._thread.start()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The environment an AWS client needs to use this server (and only it)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def create_bucket(self, name: str) -> None:
        create_bucket(self.endpoint, name)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def create_bucket(endpoint: str, name: str) -> None:
    """Create bucket ``name`` on the server at ``endpoint`` (one PUT, no AWS configuration needed)."""
    import urllib.request

    req = urllib.request.Request(f"{endpoint}/{name}", method="PUT")
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def server_stats(endpoint: str, reset: bool = False) -> dict[str, dict[str, int]]:
    """The request and byte counters of the server at ``endpoint`` (one in another process); ``reset``: zero
    them after reading."""
    import json
    import urllib.request

    req = urllib.request.Request(f"{endpoint}{STATS_PATH}", method="DELETE" if reset else "GET")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def spawn_server(*buckets: str) -> tuple[Any, dict[str, str]]:
    """An :class:`S3Server` in a process of its own with ``buckets`` created (its request handling stays
    off the GIL of the process that drives the job): the process and the AWS environment that reaches it."""
    import subprocess

    proc = subprocess.Popen(
        [sys.executable, "-m", "ucp_dev.testing.s3_server", *(x for b in buckets for x in ("--bucket", b))],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"the S3 server did not start ({line!r})")
    env = S3Server().env()
    env["AWS_ENDPOINT_URL"] = line.split()[1]
    return proc, env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--bucket", action="append", default=[], help="bucket(s) to create")
    a = ap.parse_args(argv)
    server = S3Server(a.port).start()
    for b in a.bucket:
        server.create_bucket(b)
    print(f"READY {server.endpoint}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
