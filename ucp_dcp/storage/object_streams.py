"""Streams of one object on a store (:class:`~ucp_dcp.storage.object_store.ObjectStore`): what the reader
and the writer open in place of a local file.

* :class:`RangedObjectFile`: reads of exactly the bytes asked for (no read-ahead, no block cache), a large
  read cut into pieces of :data:`RANGE_BYTES` fetched concurrently, and :meth:`~RangedObjectFile.read_ranges`
  for many ranges in flight at once;
* :class:`MultipartObjectWriter` (``s3fs``): a streamed object uploaded as a multipart upload of
  :data:`PART_BYTES` parts, several in flight (one PUT up to :data:`SINGLE_PUT_BYTES`); an error aborts the
  upload, so a failed write never leaves a partial object.

Each request goes through the store's :meth:`~ucp_dcp.storage.object_store.ObjectStore.call` (retries of a
throttled request, errors translated to :class:`~ucp_dcp.errors.StorageAccessError`). The store is typed
``Any`` here: this module sits below :mod:`ucp_dcp.storage.object_store`, which opens these streams.
"""

from __future__ import annotations

import bisect
import io
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .._compat import cat_ranges_concurrently

__all__ = ["PART_BYTES", "RANGE_BYTES", "SINGLE_PUT_BYTES", "ObjectSizes", "RangedObjectFile", "MultipartObjectWriter"]

PART_BYTES = 8 << 20
"""Size of a multipart upload's parts (S3's minimum is 5 MiB, except the last part)."""
SINGLE_PUT_BYTES = 64 << 20
"""An object up to this size is one PUT (a multipart upload costs three requests more and the store's
reassembly); a larger one becomes a multipart upload as soon as it passes this size."""
RANGE_BYTES = 8 << 20
"""A read larger than this is cut into ranged GETs of about this size, fetched concurrently."""


def cut_range(start: int, n: int) -> list[tuple[int, int]]:
    """``[start, start + n)`` as ``(start, end)`` pieces of equal size, as many as ``n / RANGE_BYTES`` rounded
    (each at most 1.5x :data:`RANGE_BYTES`): 8 MiB and a record frame stay one GET, not 8 MiB and 2 KiB."""
    count = max(1, round(n / RANGE_BYTES))
    bounds = [start + n * k // count for k in range(count + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


class ObjectSizes:
    """Sizes of objects, each asked for once (one HEAD, however many streams of a load open the object at
    once: the reader's tasks split a rank's reads of one object)."""

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[type, tuple]:
        return (ObjectSizes, ())  # a reader pickled (async saves, DCP's process staging) asks again

    def size(self, store: Any, path: str) -> int:
        """The size of object ``path`` of ``store`` (a HEAD the first time); FileNotFoundError when absent."""
        with self._lock:
            lock = self._locks.setdefault(path, threading.Lock())
        with lock:
            if path not in self._sizes:
                got = store.size(path)
                if got is None:
                    raise FileNotFoundError(path)
                self._sizes[path] = got
            return self._sizes[path]


class RangedObjectFile(io.RawIOBase):
    """Read-only, seekable view of one object. Every read is a ranged GET of exactly the bytes asked
    for (no read-ahead, no block cache); a read larger than :data:`RANGE_BYTES` is cut into pieces
    fetched concurrently. ``fetched`` counts the bytes the store sent."""

    def __init__(self, store: Any, path: str, size: int | None = None, known: ObjectSizes | None = None) -> None:
        self.store, self.path = store, path
        self._known = known if known is not None else ObjectSizes()
        self._size = size
        self.pos = 0
        self.fetched = 0
        self._held: list[tuple[int, bytes]] = []
        self._held_starts: list[int] = []

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def size(self) -> int:
        """The object's size (one HEAD request, on first use)."""
        if self._size is None:
            self._size = self._known.size(self.store, self.path)
        return self._size

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.size + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def prefetch(self, ranges: list[tuple[int, int]]) -> None:
        """Fetch ``(start, length)`` ranges now, all in flight at once; reads inside one of them are then
        served from it (replacing what an earlier prefetch held)."""
        datas = self.read_ranges(ranges)
        self._held = [(s, d) for (s, _), d in zip(ranges, datas)]
        self._held_starts = [s for s, _ in self._held]

    def _from_held(self, start: int, mv: memoryview) -> bool:
        k = bisect.bisect_right(self._held_starts, start) - 1
        if k < 0:
            return False
        s, data = self._held[k]
        if start + len(mv) > s + len(data):
            return False
        mv[:] = data[start - s : start - s + len(mv)]
        return True

    def readinto(self, out: Any) -> int:
        mv = memoryview(out).cast("B")
        n = len(mv)
        if n == 0:
            return 0
        start = self.pos
        if self._held and self._from_held(start, mv):
            self.pos += n
            return n
        if self._size is not None:
            n = max(0, min(n, self._size - start))
            if n == 0:
                return 0
        pieces = cut_range(start, n)
        datas = self.store.call("GET", self.path, lambda: self._fetch(pieces))
        got = 0
        for (s, e), data in zip(pieces, datas):
            k = len(data)
            mv[s - start : s - start + k] = data
            got += k
            if k < e - s:
                break  # the object ended
        self.pos += got
        self.fetched += got
        return got

    def read_ranges(self, ranges: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of ``(start, length)`` ranges, all requested at once (ranged GETs in flight together,
        a range over :data:`RANGE_BYTES` cut into pieces); a range past the object's end comes back short."""
        pieces: list[tuple[int, int]] = []
        owner: list[int] = []
        for k, (s, n) in enumerate(ranges):
            for piece in cut_range(s, n):
                pieces.append(piece)
                owner.append(k)
        datas = self.store.call("GET", self.path, lambda: self._fetch(pieces)) if pieces else []
        out: list[list[bytes]] = [[] for _ in ranges]
        for k, data in zip(owner, datas):
            out[k].append(data)
        got = [b"".join(parts) if len(parts) != 1 else parts[0] for parts in out]
        self.fetched += sum(len(g) for g in got)
        return got

    def _fetch(self, pieces: list[tuple[int, int]]) -> list[bytes]:
        fs = self.store.fs
        got = cat_ranges_concurrently(fs, self.path, pieces) if len(pieces) > 1 else None
        if got is not None:
            return got
        try:
            return [fs.cat_file(self.path, start=s, end=e) for s, e in pieces]
        except OSError as e:
            if "InvalidRange" in str(e) or "416" in str(e):
                return [b""]  # reading at or past the end
            raise

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = max(0, self.size - self.pos)
        buf = bytearray(n)
        got = self.readinto(buf)
        return bytes(buf[:got])


class MultipartObjectWriter(io.RawIOBase):
    """A write-only stream uploaded to S3 as one multipart upload: every :data:`PART_BYTES` of
    written bytes become a part sent while the next are written, at most ``in_flight`` at once. An
    object of at most :data:`SINGLE_PUT_BYTES` is a single PUT. ``close`` completes the upload (the object
    appears then, whole); an error aborts it, so a failed write never leaves a partial object."""

    def __init__(self, store: Any, path: str, part_bytes: int | None, in_flight: int) -> None:
        self.store, self.path = store, path
        self.bucket, self.key, _ = store.fs.split_path(path)
        part = PART_BYTES if part_bytes is None else part_bytes  # None: the module's size (tests lower it)
        self.part_bytes, self.in_flight = max(5 << 20, part), max(1, in_flight)
        self._buf = bytearray()
        self._parts: deque[Future[dict[str, Any]]] = deque()
        self._done: list[dict[str, Any]] = []
        self._pool: ThreadPoolExecutor | None = None
        self.upload_id: str | None = None
        self.parts = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self._buf += mv
        if self.upload_id is None and len(self._buf) <= SINGLE_PUT_BYTES:
            return len(mv)  # may still be one PUT at close
        while len(self._buf) >= self.part_bytes:
            self._send(bytes(self._buf[: self.part_bytes]))
            del self._buf[: self.part_bytes]
        return len(mv)

    def flush(self) -> None:  # parts go out when full; the object exists only after close
        pass

    def _send(self, data: bytes) -> None:
        s = self.store
        if self.upload_id is None:
            self._pool = ThreadPoolExecutor(self.in_flight)
            out = s.call(
                "PUT", self.path, lambda: s.s3_call("create_multipart_upload", Bucket=self.bucket, Key=self.key)
            )
            self.upload_id = out["UploadId"]
        self.parts += 1
        number = self.parts

        def upload() -> dict[str, Any]:
            r = s.call(
                "PUT",
                f"{self.path} (part {number})",
                lambda: s.s3_call(
                    "upload_part",
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=self.upload_id,
                    PartNumber=number,
                    Body=data,
                ),
            )
            return {"PartNumber": number, "ETag": r["ETag"]}

        assert self._pool is not None
        self._parts.append(self._pool.submit(upload))
        while len(self._parts) >= self.in_flight:  # bounded memory: wait for the oldest part
            self._done.append(self._parts.popleft().result())

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._finish()
        except BaseException:  # re-raised; the parts uploaded so far are aborted, not left billed in the bucket
            self.abort()
            raise
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            super().close()

    def _finish(self) -> None:
        s = self.store
        if self.upload_id is None:
            s.put(self.path, bytes(self._buf))
            return
        if self._buf:
            self._send(bytes(self._buf))
            self._buf = bytearray()
        while self._parts:
            self._done.append(self._parts.popleft().result())
        parts = sorted(self._done, key=lambda p: p["PartNumber"])
        s.call(
            "PUT",
            self.path,
            lambda: s.s3_call(
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
            ),
        )

    def abort(self) -> None:
        """Abort the upload (its parts are dropped by the store); errors here are not the first one."""
        if self.upload_id is None:
            return
        for f in self._parts:
            f.cancel()
        s = self.store
        try:
            s.call(
                "DELETE",
                self.path,
                lambda: s.s3_call("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id),
            )
        except Exception:  # best effort while failing already: the caller's error is the one to see
            pass  # the next save's cleanup aborts what is left (ObjectStore.abort_uploads)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self.abort()
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            io.RawIOBase.close(self)
            return
        self.close()
