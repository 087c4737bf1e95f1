"""A counting TCP proxy in front of a torch ``TCPStore`` server: how many store requests, of which kinds, and how
many bytes each client connection makes. Library-free (the standard library only; no torch import).

    meter = StoreMeter("127.0.0.1", store.port).start()   # the store's server runs elsewhere (this process, a
    ...                                                    # torchrun agent); clients connect to meter.port
    meter.set_owner(pid, "rank3")                          # attribute that process's connections to a label
    before = meter.snapshot(); ...; after = meter.snapshot()
    window = diff(before, after)                           # totals, by command, by owner, in that window
    meter.close()

    python recipes/store_meter.py --selftest               # a TCPStore behind the meter, every command once

It forwards bytes unchanged in both directions from one thread (a ``selectors`` loop), and parses the client ->
server stream with torch's TCPStore wire protocol (torch 2.11-2.15; the libuv server, torch's default since 2.4, and
the legacy one read the same requests). From ``torch/csrc/distributed/c10d``: ``TCPStoreBackend.hpp`` (the
``QueryType`` enum), ``TCPStore.cpp`` (the client's ``SendBuffer``: one command byte, then its arguments; a string or
byte vector is a little-endian uint64 length and its bytes), ``TCPStoreLibUvBackend.cpp`` (``parse_*_command``: what
the server reads per command):

=====  ============  =====================================================================
byte   command       arguments after the command byte
=====  ============  =====================================================================
0      VALIDATE      uint32 magic (0x3C85F7CE); a connection's first request
1      SET           key, value
2      COMPARE_SET   key, expected value, desired value
3      GET           key                  (``store.get`` sends a WAIT for the key first)
4      ADD           key, int64 delta
5      CHECK         uint64 n, n keys
6      WAIT          uint64 n, n keys     (answered when the keys exist; CANCEL_WAIT on timeout)
7      GETNUMKEYS    -
8      DELETE_KEY    key
9      APPEND        key, value
10     MULTI_GET     uint64 n, n keys     (``multi_get`` sends a WAIT for the keys first)
11     MULTI_SET     int64 n, n x (key, value)
12     CANCEL_WAIT   -
13     PING          uint32 nonce         (after VALIDATE, on connect)
14-16  QUEUE_PUSH     key, value / QUEUE_POP: key (a blocking pop WAITs first) / QUEUE_LEN: key
17     LIST_KEYS     -
18     BARRIER       key, int64 world size
=====  ============  =====================================================================

A request is counted once all its bytes arrived, under the command byte's name. Server -> client bytes are counted,
not parsed (answers are not framed per request: a WAIT's answer comes whenever the key appears). Where the parser
meets something it does not know (a command byte past 18, a length no server would accept: a newer or older wire
format), that connection's later bytes are counted as ``unparsed_bytes`` and its ``parse_error`` says why; the
bytes are still forwarded: the meter never breaks a connection.

Attribution: each accepted connection's client end is looked up in ``/proc/net/tcp`` (its socket's inode) and
then among the file descriptors of the processes given to :meth:`StoreMeter.set_owner` (Linux), from a second
thread so forwarding never waits for it. A connection whose process is found gets that process's label, so every
connection a rank opens (its first store client, ``store.clone()``, a heartbeat's own client) counts for that rank;
one not found (another OS, a process not registered, one closed before the lookup) is labelled ``conn<k>``, k in
order of connection. Each connection also records the first key it touched (``first_key``), another clue.
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import queue
import re
import selectors
import socket
import struct
import sys
import threading
import time
from typing import Any

__all__ = ["COMMANDS", "RequestParser", "StoreMeter", "by_owner", "diff"]

# QueryType (TCPStoreBackend.hpp) -> (name, argument layout)
COMMANDS: dict[int, tuple[str, tuple[str, ...]]] = {
    0: ("VALIDATE", ("u32",)),
    1: ("SET", ("key", "bytes")),
    2: ("COMPARE_SET", ("key", "bytes", "bytes")),
    3: ("GET", ("key",)),
    4: ("ADD", ("key", "i64")),
    5: ("CHECK", ("keys",)),
    6: ("WAIT", ("keys",)),
    7: ("GETNUMKEYS", ()),
    8: ("DELETE_KEY", ("key",)),
    9: ("APPEND", ("key", "bytes")),
    10: ("MULTI_GET", ("keys",)),
    11: ("MULTI_SET", ("pairs",)),
    12: ("CANCEL_WAIT", ()),
    13: ("PING", ("u32",)),
    14: ("QUEUE_PUSH", ("key", "bytes")),
    15: ("QUEUE_POP", ("key",)),
    16: ("QUEUE_LEN", ("key",)),
    17: ("LIST_KEYS", ()),
    18: ("BARRIER", ("key", "i64")),
}
# Beyond what any server accepts (libuv: keys of 8 KiB, values of 8 MiB, 128 Ki keys per request): past these the
# stream is not the protocol we know, and guessing on would count garbage as requests
MAX_KEY = 1 << 20
MAX_VALUE = 1 << 31
MAX_KEYS = 1 << 20
MAX_FAMILIES = 256  # distinct key families kept in the totals; the rest count under "(other)"
_U32, _U64, _I64 = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<q")
_READ, _SKIP = 0, 1
# a key's family: its digit runs and long hex runs (ranks, sequence numbers, hashes) replaced by '#'
_VARIABLE = re.compile(r"[0-9a-f]{8,}|\d+")


def key_family(key: bytes) -> str:
    return _VARIABLE.sub("#", key[:200].decode("utf-8", errors="replace"))


class _Unknown(Exception):
    """The stream is not a request this parser knows."""


class RequestParser:
    """Incremental parser of a TCPStore client -> server byte stream.

    ``feed(data)`` with whatever arrived; ``on_request(name, nbytes, keys)`` is called per complete request. Value
    bytes are skipped, never buffered (a SET of many MiB costs no copy). After an error, bytes are only counted.
    """

    def __init__(self, on_request: Any) -> None:
        self.on_request = on_request
        self.error: str | None = None
        self.unparsed_bytes = 0
        self._buf = bytearray()
        self._consumed = 0  # bytes parsed so far (this stream)
        self._start = 0  # where the request being parsed began
        self._gen = self._requests()
        self._want: tuple[int, int] = next(self._gen)

    def feed(self, data: bytes) -> None:
        if self.error is not None:
            self.unparsed_bytes += len(data)
            return
        i, n = 0, len(data)
        try:
            while i < n:
                kind, want = self._want
                if kind == _SKIP:
                    take = min(want, n - i)
                    i += take
                    self._consumed += take
                    if take < want:
                        self._want = (_SKIP, want - take)
                        break
                    self._want = self._gen.send(None)
                else:
                    take = min(want - len(self._buf), n - i)
                    self._buf += data[i : i + take]
                    i += take
                    self._consumed += take
                    if len(self._buf) < want:
                        break
                    got = bytes(self._buf)
                    self._buf.clear()
                    self._want = self._gen.send(got)
        except Exception as e:  # _Unknown, or a bug here: count bytes from now on, never break the connection
            self.error = str(e) if isinstance(e, _Unknown) else f"parser error: {type(e).__name__}: {e}"
            self.unparsed_bytes += (self._consumed - self._start) + (n - i)
            self._buf.clear()

    def _requests(self):  # yields (_READ | _SKIP, n), receives the bytes read (None for a skip)
        while True:
            self._start = self._consumed
            cmd = (yield (_READ, 1))[0]
            spec = COMMANDS.get(cmd)
            if spec is None:
                raise _Unknown(f"unknown command byte {cmd} at stream offset {self._start}")
            name, layout = spec
            keys: list[bytes] = []
            for field in layout:
                if field == "u32":
                    yield (_READ, 4)
                elif field == "i64":
                    yield (_READ, 8)
                elif field == "key":
                    keys.append((yield from self._key(name)))
                elif field == "bytes":
                    yield from self._value(name)
                elif field == "keys":
                    count = _U64.unpack((yield (_READ, 8)))[0]
                    if count > MAX_KEYS:
                        raise _Unknown(f"{name} of {count} keys")
                    for _ in range(count):
                        keys.append((yield from self._key(name)))
                elif field == "pairs":
                    count = _I64.unpack((yield (_READ, 8)))[0]
                    if not 0 <= count <= MAX_KEYS:
                        raise _Unknown(f"{name} of {count} pairs")
                    for _ in range(count):
                        keys.append((yield from self._key(name)))
                        yield from self._value(name)
            self.on_request(name, self._consumed - self._start, keys)

    def _key(self, name: str):
        size = _U64.unpack((yield (_READ, 8)))[0]
        if size > MAX_KEY:
            raise _Unknown(f"{name} with a key of {size} bytes")
        return (yield (_READ, size)) if size else b""

    def _value(self, name: str):
        size = _U64.unpack((yield (_READ, 8)))[0]
        if size > MAX_VALUE:
            raise _Unknown(f"{name} with a value of {size} bytes")
        if size:
            yield (_SKIP, size)


def _new_counts() -> dict:
    return {"requests": collections.Counter(), "request_bytes": collections.Counter(), "bytes_up": 0, "bytes_down": 0}


class _Conn:
    def __init__(self, cid: int, client: socket.socket, upstream: socket.socket, peer: Any, meter: StoreMeter) -> None:
        self.cid = cid
        self.client, self.upstream = client, upstream
        self.peer = peer
        self.out = {client: bytearray(), upstream: bytearray()}  # bytes waiting to be written to that socket
        self.reading = {client: True, upstream: True}
        self.events = {client: selectors.EVENT_READ, upstream: selectors.EVENT_READ}  # as registered
        self.closed = False
        self.info: dict[str, Any] = {
            "label": f"conn{cid}",
            "pid": None,
            "peer": f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer),
            "opened_at": time.monotonic(),
            "closed_at": None,
            "first_key": None,
            "owner_lookup": None,
            "parse_error": None,
            "unparsed_bytes": 0,
            **_new_counts(),
        }
        self.parser = RequestParser(lambda name, nbytes, keys: meter._on_request(self, name, nbytes, keys))

    def other(self, sock: socket.socket) -> socket.socket:
        return self.upstream if sock is self.client else self.client


class StoreMeter:
    """A counting proxy: listens on ``host:port`` (0: any free port), forwards to ``upstream_host:upstream_port``."""

    BUFFER_LIMIT = 8 << 20  # stop reading a side while this much waits to be written to the other

    def __init__(self, upstream_host: str, upstream_port: int, host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server((host, port), backlog=1024)
        self._listener.setblocking(False)
        self.host, self.port = self._listener.getsockname()[:2]
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._conns: dict[int, _Conn] = {}
        self._by_sock: dict[socket.socket, _Conn] = {}
        self._next_id = 0
        self._owners: dict[int, str] = {}
        self._lookups: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._reset_counts()
        self._thread = threading.Thread(target=self._loop, name="store-meter", daemon=True)
        self._resolver = threading.Thread(target=self._resolve_loop, name="store-meter-owners", daemon=True)

    # -- public API --------------------------------------------------------------------------------

    def start(self) -> StoreMeter:
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread.start()
        self._resolver.start()
        return self

    def set_owner(self, pid: int, label: str) -> None:
        """Connections from process ``pid`` (found by their socket, see the module docstring) count for ``label``."""
        with self._lock:
            self._owners[pid] = label

    def snapshot(self) -> dict:
        """A copy of every counter now: totals, by command, by key family, and per connection."""
        with self._lock:
            snap = copy.deepcopy(self._totals)
            snap["time"] = time.monotonic()
            snap["connections_open"] = sum(1 for c in self._conns.values() if not c.closed)
            snap["connections"] = {cid: copy.deepcopy(c.info) for cid, c in self._conns.items()}
        for rec in [snap, *snap["connections"].values()]:
            for k in ("requests", "request_bytes", "families"):
                if k in rec:
                    rec[k] = dict(rec[k])
        return snap

    def reset(self) -> None:
        """Zero every counter (connections stay open, their labels stay)."""
        with self._lock:
            self._reset_counts()
            for c in self._conns.values():
                c.info.update(_new_counts(), unparsed_bytes=0)

    def close(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._lookups.put(None)
        self._resolver.join(timeout=5)
        for c in list(self._conns.values()):
            self._close_conn(c)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()
        self._sel.close()

    # -- counting (called on the forwarding thread) -------------------------------------------------

    def _reset_counts(self) -> None:
        self._totals: dict[str, Any] = {
            "connections_opened": 0,
            "connections_closed": 0,
            "unparsed_bytes": 0,
            "unparsed_connections": 0,
            "families": collections.Counter(),
            **_new_counts(),
        }

    def _on_request(self, conn: _Conn, name: str, nbytes: int, keys: list[bytes]) -> None:
        with self._lock:
            for rec in (self._totals, conn.info):
                rec["requests"][name] += 1
                rec["request_bytes"][name] += nbytes
            if keys:
                if conn.info["first_key"] is None:
                    conn.info["first_key"] = keys[0][:200].decode("utf-8", errors="replace")
                fam = key_family(keys[0])
                families = self._totals["families"]
                if fam not in families and len(families) >= MAX_FAMILIES:
                    fam = "(other)"
                families[f"{name} {fam}"] += 1

    def _count_bytes(self, conn: _Conn, up: bool, n: int) -> None:
        key = "bytes_up" if up else "bytes_down"
        with self._lock:
            self._totals[key] += n
            conn.info[key] += n

    # -- the forwarding loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, events in self._sel.select(timeout=1.0):
                sock = key.fileobj
                try:
                    if sock is self._listener:
                        self._accept()
                    elif sock is self._wake_r:
                        self._wake_r.recv(64)
                    else:
                        conn = self._by_sock.get(sock)  # type: ignore[call-overload]
                        if conn is None or conn.closed:
                            continue
                        if events & selectors.EVENT_WRITE:
                            self._flush(conn, sock)  # type: ignore[arg-type]
                        if events & selectors.EVENT_READ and not conn.closed:
                            self._read(conn, sock)  # type: ignore[arg-type]
                except Exception as e:  # one connection's trouble must not stop the others
                    print(f"store_meter: {type(e).__name__}: {e}", file=sys.stderr)

    def _accept(self) -> None:
        while True:
            try:
                client, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=30)
            except OSError as e:  # the store is gone: the client sees a closed connection, as it would without us
                print(f"store_meter: cannot reach the store at {self.upstream}: {e}", file=sys.stderr)
                client.close()
                continue
            for s in (client, upstream):
                s.setblocking(False)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as the store's own sockets
            with self._lock:
                cid = self._next_id
                self._next_id += 1
                conn = _Conn(cid, client, upstream, peer, self)
                self._conns[cid] = conn
                self._totals["connections_opened"] += 1
            self._by_sock[client] = self._by_sock[upstream] = conn
            self._sel.register(client, selectors.EVENT_READ, None)
            self._sel.register(upstream, selectors.EVENT_READ, None)
            self._lookups.put(conn)

    def _read(self, conn: _Conn, sock: socket.socket) -> None:
        try:
            data = sock.recv(1 << 18)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # that side closed: pass on what is pending, then close both (the protocol has no half-close)
            other = conn.other(sock)
            try:
                other.setblocking(True)
                other.settimeout(5)
                other.sendall(conn.out[other])
            except OSError:
                pass
            self._close_conn(conn)
            return
        up = sock is conn.client
        self._count_bytes(conn, up, len(data))
        if up:
            before = conn.parser.unparsed_bytes
            conn.parser.feed(data)
            if conn.parser.error is not None:
                with self._lock:
                    if conn.info["parse_error"] is None:
                        conn.info["parse_error"] = conn.parser.error
                        self._totals["unparsed_connections"] += 1
                    grew = conn.parser.unparsed_bytes - before
                    conn.info["unparsed_bytes"] += grew
                    self._totals["unparsed_bytes"] += grew
        other = conn.other(sock)
        conn.out[other] += data
        self._flush(conn, other)
        if len(conn.out[other]) > self.BUFFER_LIMIT:  # back-pressure: the other side reads slowly
            conn.reading[sock] = False
            self._update(conn, sock)

    def _flush(self, conn: _Conn, sock: socket.socket) -> None:
        buf = conn.out[sock]
        while buf:
            try:
                sent = sock.send(buf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._close_conn(conn)
                return
            del buf[:sent]
        src = conn.other(sock)
        if not conn.reading[src] and len(buf) <= self.BUFFER_LIMIT // 2:
            conn.reading[src] = True
            self._update(conn, src)
        self._update(conn, sock)

    def _update(self, conn: _Conn, sock: socket.socket) -> None:
        if conn.closed:
            return
        events = (selectors.EVENT_READ if conn.reading[sock] else 0) | (selectors.EVENT_WRITE if conn.out[sock] else 0)
        if events == conn.events[sock]:
            return
        try:
            if not events:
                self._sel.unregister(sock)
            elif conn.events[sock]:
                self._sel.modify(sock, events, None)
            else:
                self._sel.register(sock, events, None)
            conn.events[sock] = events
        except (KeyError, ValueError, OSError):
            pass

    def _close_conn(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        for s in (conn.client, conn.upstream):
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError, OSError):
                pass
            self._by_sock.pop(s, None)
            try:
                s.close()
            except OSError:
                pass
        with self._lock:
            conn.info["closed_at"] = time.monotonic()
            self._totals["connections_closed"] += 1

    # -- owners: which process a connection comes from ------------------------------------------------

    def _resolve_loop(self) -> None:
        while True:
            batch = [self._lookups.get()]
            while True:  # connections opened together (every rank at once) are looked up together
                try:
                    batch.append(self._lookups.get_nowait())
                except queue.Empty:
                    break
            if None in batch:
                return
            for attempt in range(3):  # a process registered just after it connected: look again, briefly
                try:
                    found, why = _owners_of([c.peer for c in batch], self.port, list(self._owners))
                except Exception as e:
                    found, why = {}, f"{type(e).__name__}: {e}"
                with self._lock:
                    for c in batch:
                        pid = found.get(c.peer)
                        if pid is not None:
                            c.info["pid"] = pid
                            c.info["label"] = self._owners.get(pid, c.info["label"])
                        c.info["owner_lookup"] = {
                            "after_s": round(time.monotonic() - c.info["opened_at"], 4),
                            "failed": None
                            if pid is not None
                            else why.get(c.peer, "?")
                            if isinstance(why, dict)
                            else why,
                        }
                batch = [c for c in batch if c.info["pid"] is None and not c.closed]
                if not batch:
                    break
                time.sleep(0.02 * (attempt + 1))


def _owners_of(peers: list[Any], server_port: int, pids: list[int]) -> tuple[dict, dict]:
    """``{peer: pid}`` for the loopback connections from ``peers`` to our ``server_port`` whose client socket one of
    ``pids`` holds, and ``{peer: why}`` for the others. One read of the socket tables, one pass over the fds."""
    ports = {p[1]: p for p in peers if isinstance(p, tuple)}
    inodes: dict[int, Any] = {}  # socket inode -> peer
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split(None, 10)
                    if len(fields) < 10:
                        continue
                    local, remote = fields[1], fields[2]
                    port = int(local[local.rindex(":") + 1 :], 16)
                    if port in ports and int(remote[remote.rindex(":") + 1 :], 16) == server_port:
                        inodes[int(fields[9])] = ports[port]
        except OSError:
            continue
    found: dict[Any, int] = {}
    want = {f"socket:[{i}]": peer for i, peer in inodes.items()}
    for pid in pids:
        if len(found) == len(want):
            break
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                peer = want.get(os.readlink(f"{fd_dir}/{fd}"))
            except OSError:
                continue
            if peer is not None:
                found[peer] = pid
    why = {
        p: "no such socket" if p not in inodes.values() else "no registered process" for p in peers if p not in found
    }
    return found, why


# -- reading snapshots -----------------------------------------------------------------------------------


def diff(before: dict, after: dict) -> dict:
    """What happened between two snapshots of one meter: totals, by command, by key family, per connection
    (those opened in between included), and ``seconds`` between them."""
    out: dict[str, Any] = {"seconds": after["time"] - before["time"]}
    for k in ("connections_opened", "connections_closed", "unparsed_bytes", "unparsed_connections"):
        out[k] = after[k] - before[k]
    out["bytes_up"] = after["bytes_up"] - before["bytes_up"]
    out["bytes_down"] = after["bytes_down"] - before["bytes_down"]
    for k in ("requests", "request_bytes", "families"):
        out[k] = _sub(after[k], before[k])
    out["requests_total"] = sum(out["requests"].values())
    conns = {}
    for cid, a in after["connections"].items():
        b = before["connections"].get(cid)
        rec = {k: a[k] for k in ("label", "pid", "first_key", "parse_error")}
        rec["opened"] = b is None
        rec["requests"] = _sub(a["requests"], b["requests"] if b else {})
        rec["requests_total"] = sum(rec["requests"].values())
        for k in ("bytes_up", "bytes_down", "unparsed_bytes"):
            rec[k] = a[k] - (b[k] if b else 0)
        if rec["requests_total"] or rec["bytes_up"] or rec["bytes_down"] or rec["opened"]:
            conns[cid] = rec
    out["connections"] = conns
    return out


def _sub(a: dict, b: dict) -> dict:
    out = {k: v - b.get(k, 0) for k, v in a.items()}
    return {k: v for k, v in out.items() if v}


def by_owner(window: dict) -> dict[str, dict]:
    """A :func:`diff` window's connections summed per label: ``{label: {requests_total, bytes, connections_opened,
    requests: {command: n}}}``."""
    out: dict[str, dict] = {}
    for rec in window["connections"].values():
        o = out.setdefault(
            rec["label"], {"requests_total": 0, "bytes": 0, "connections_opened": 0, "requests": collections.Counter()}
        )
        o["requests_total"] += rec["requests_total"]
        o["bytes"] += rec["bytes_up"] + rec["bytes_down"]
        o["connections_opened"] += int(rec["opened"])
        o["requests"].update(rec["requests"])
    for o in out.values():
        o["requests"] = dict(o["requests"])
    return out


# -- self-test ---------------------------------------------------------------------------------------------


def _selftest_client(port: int) -> None:
    """The client half of the self-test (its own process: torch's queue calls keep the GIL while they wait for
    the answer, which would stall a meter thread in the same process)."""
    from datetime import timedelta

    import torch.distributed as dist

    c = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    c.set("a", b"x" * 100_000)
    assert c.get("a") == b"x" * 100_000
    c.add("n", 3)
    c.compare_set("a", b"nope", b"y")
    c.check(["a", "zz"])
    c.wait(["a"])
    c.num_keys()
    c.delete_key("n")
    c.append("ap", b"1")
    c.multi_set(["m1", "m2"], [b"1", b"2"])
    c.multi_get(["m1", "m2"])
    c.queue_push("q", b"v")
    c.queue_len("q")
    c.queue_pop("q")
    try:
        c.wait(["never"], timedelta(milliseconds=50))
    except Exception:
        pass
    c.list_keys()
    c2 = c.clone()  # a new connection: VALIDATE + PING, from this process
    c2.set("b", b"1")
    time.sleep(0.5)  # the owner lookup runs on the meter's second thread: this process must still hold the socket


def _selftest() -> int:
    """Every command through the meter against a real TCPStore (libuv server), checked against what was sent."""
    import subprocess

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False, use_libuv=True)
    meter = StoreMeter("127.0.0.1", server.port).start()
    s0 = meter.snapshot()
    child = subprocess.Popen([sys.executable, __file__, "--selftest-client", str(meter.port)])
    meter.set_owner(child.pid, "child")  # before it connects: python and torch take a second to start
    rc = child.wait(timeout=120)
    w = diff(s0, meter.snapshot())
    meter.close()
    print(f"requests: {w['requests']}")
    print(f"bytes up {w['bytes_up']}, down {w['bytes_down']}, unparsed {w['unparsed_bytes']}")
    print(f"owners: {by_owner(w)}")
    print(f"families: {w['families']}")
    want = {"SET": 2, "GET": 1, "ADD": 1, "COMPARE_SET": 1, "CHECK": 1, "DELETE_KEY": 1, "APPEND": 1}
    want |= {"MULTI_SET": 1, "MULTI_GET": 1, "QUEUE_PUSH": 1, "QUEUE_LEN": 1, "QUEUE_POP": 1, "GETNUMKEYS": 1}
    want |= {"VALIDATE": 2, "PING": 2, "CANCEL_WAIT": 1, "LIST_KEYS": 1}
    bad = {k: (w["requests"].get(k), v) for k, v in want.items() if w["requests"].get(k) != v}
    # WAIT: the explicit one, the timed-out one, and the ones get / multi_get / the blocking queue_pop send first
    if w["requests"].get("WAIT") != 5:
        bad["WAIT"] = (w["requests"].get("WAIT"), 5)
    if rc or w["unparsed_bytes"] or set(by_owner(w)) != {"child"} or w["connections_opened"] != 2:
        bad["client/parse/attribution"] = (rc, w["unparsed_bytes"], set(by_owner(w)), w["connections_opened"])
    print("SELFTEST " + ("OK" if not bad else f"FAILED: {bad}"))
    return 1 if bad else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--selftest", action="store_true", help="every command through the meter against a TCPStore")
    ap.add_argument("--selftest-client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.selftest_client:
        _selftest_client(a.selftest_client)
        sys.exit(0)
    if not a.selftest:
        ap.print_help()
        sys.exit(0)
    sys.exit(_selftest())
