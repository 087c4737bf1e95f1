"""One checkpoint prefix on an object store (S3 and S3-compatible stores through ``s3fs``, GCS, Azure,
fsspec's ``memory://``), as the writer, the reader and the commit use it.

An object store has no rename (a "rename" is a copy), but a single-object write (``PUT``) is atomic:
a reader sees the old object or the new one. That is all :mod:`ucp_dcp.storage.object_commit` needs.
This module gives the operations the commit and the reads are made of, each a request the store
answers for that object alone, never from a listing or a client-side cache of one (a listing may
miss an object written a moment ago; a commit that trusted one could drop or skip it):

* ``get`` / ``size`` / ``put`` / ``remove`` of one object, ``names`` (a listing: used only to find stale
  objects to remove, where missing a fresh one only leaves it for the next save);
* streams of one object (:mod:`ucp_dcp.storage.object_streams`): ranged reads of exactly the bytes asked
  for, and multipart uploads with parts in flight.

Failures come back as :class:`~ucp_dcp.errors.StorageAccessError` naming the request: a bucket that
does not exist, missing credentials, a denied request; a throttled request (``SlowDown``, HTTP 503)
is retried with exponential backoff first (after the client's own retries).

Every request, the streams' included, goes through :meth:`ObjectStore.call` (retries and error translation).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .._compat import s3_call
from ..errors import StorageAccessError
from .object_streams import MultipartObjectWriter, ObjectSizes, RangedObjectFile

__all__ = ["OBJECT_PROTOCOLS", "object_protocol", "refused", "ObjectStore"]

OBJECT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"})
"""fsspec protocols whose single-object writes are atomic (the commit point needs nothing else)."""
RETRIES = 4
"""Attempts of a throttled request (after the client's own retries) before it is an error."""
BACKOFF_S = 0.25
"""First wait before retrying a throttled request; doubled after each attempt."""

T = TypeVar("T")


def object_protocol(path: str | os.PathLike) -> str | None:
    """The fsspec protocol of an URL (``"s3"`` for ``s3://b/k``), None for a local path."""
    text = str(path)
    return text.split("://", 1)[0].lower() if "://" in text else None


def _store_error(e: BaseException) -> bool:
    """A failure of the request (the store's answer or the client's), not of our code."""
    return isinstance(e, OSError) or type(e).__module__.split(".")[0] in ("botocore", "aiobotocore", "s3fs")


def _throttled(e: BaseException) -> bool:
    text = str(e)
    return (isinstance(e, OSError) and e.errno == errno.EBUSY) or any(
        s in text for s in ("SlowDown", "reduce your request rate", "Throttl", "TooManyRequests", "Service Unavailable")
    )


def refused(op: str, path: str, e: BaseException) -> StorageAccessError:
    """The :class:`StorageAccessError` for a request ``op`` on ``path`` that failed with ``e``."""
    name = type(e).__name__
    bucket = path.split("://", 1)[-1].split("/", 1)[0]
    if isinstance(e, FileNotFoundError):
        return StorageAccessError(
            f"{op} {path}: bucket '{bucket}' does not exist ({e})",
            saved=bucket,
            hint="check the bucket in the URL, and that the endpoint (AWS_ENDPOINT_URL, storage_options) "
            "is the store that holds it; ucp_dcp never creates buckets",
        )
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return StorageAccessError(
            f"{op} {path}: no credentials for the store ({name}: {e})",
            hint="set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or a profile, an instance role), or pass "
            "storage_options={'key': ..., 'secret': ...}",
        )
    if isinstance(e, PermissionError) or "AccessDenied" in str(e) or "Forbidden" in str(e):
        return StorageAccessError(
            f"{op} {path}: the store denied the request ({e})",
            saved=path,
            hint="the credentials need read, write, delete and list rights on the prefix "
            "(s3:GetObject, s3:PutObject, s3:DeleteObject, s3:ListBucket, s3:AbortMultipartUpload)",
        )
    return StorageAccessError(f"{op} {path} failed: {name}: {e}", saved=path, hint="see the store's error above")


class ObjectStore:
    """The objects under one URL prefix (``s3://bucket/run``).

    Args:
        url: the prefix, as given to the writer or reader.
        storage_options: passed to fsspec's ``url_to_fs`` (endpoint, credentials, ...); without them
            the client's usual configuration applies (``AWS_*`` environment variables, config files).
        retries: attempts of a throttled request (None: :data:`RETRIES`); ``backoff_s``: the first
            wait, doubled each time (None: :data:`BACKOFF_S`).
    """

    def __init__(
        self,
        url: str | os.PathLike,
        storage_options: dict[str, Any] | None = None,
        *,
        retries: int | None = None,
        backoff_s: float | None = None,
    ) -> None:
        from fsspec.core import url_to_fs

        self.url = str(url).rstrip("/")
        self.protocol = object_protocol(self.url) or ""
        self.fs, self.root = url_to_fs(self.url, **(storage_options or {}))
        self.retries = max(1, RETRIES if retries is None else retries)
        self.backoff_s = BACKOFF_S if backoff_s is None else backoff_s
        self.is_s3 = type(self.fs).__module__.startswith("s3fs")

    def join(self, name: str) -> str:
        """URL of the object ``name`` under the prefix."""
        return f"{self.url}/{name}"

    # -- requests, each retried when throttled and translated when refused ---------------------------

    def call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        """Run one request (``fn``); a throttled one again after a backoff, up to ``retries`` times.
        ``FileNotFoundError`` of the object itself passes through (callers ask for absence)."""
        t0 = time.monotonic()
        for attempt in range(self.retries):
            try:
                return fn()
            except FileNotFoundError as e:
                if "bucket" in str(e).lower():
                    raise refused(op, path, e) from None
                raise
            except Exception as e:  # sorted below: not the store's (re-raised), refused, or throttled (retried)
                if not _store_error(e):
                    raise
                if not _throttled(e):
                    raise refused(op, path, e) from None
                if attempt + 1 == self.retries:
                    raise StorageAccessError(
                        f"the store kept throttling {op} {path}: {self.retries} attempts over "
                        f"{time.monotonic() - t0:.1f} s, each after the client's own retries ({e})",
                        saved=path,
                        hint="lower the request rate (fewer ranks writing or reading at once, thread_count=), "
                        "spread the job over several prefixes, or ask the store's operator for a higher limit",
                    ) from None
                time.sleep(self.backoff_s * (2**attempt))
        raise AssertionError("unreachable")

    def get(self, path: str) -> bytes | None:
        """The whole object (one GET, never a cached listing), None when it does not exist."""
        try:
            return bytes(self.call("GET", path, lambda: self.fs.cat_file(path)))
        except FileNotFoundError:
            return None

    def size(self, path: str) -> int | None:
        """The object's size from a HEAD request, None when it does not exist."""

        def head() -> int:
            if self.is_s3:  # HEAD object only (s3fs's info() also lists the key as a folder when it is absent)
                bucket, key, _ = self.fs.split_path(path)
                return int(self.s3_call("head_object", Bucket=bucket, Key=key)["ContentLength"])
            self.fs.invalidate_cache(path)
            return int(self.fs.info(path)["size"])

        try:
            return self.call("HEAD", path, head)
        except FileNotFoundError:
            return None

    def put(self, path: str, data: bytes) -> None:
        """Write one object in a single request (atomic: readers see the old bytes or these)."""
        self.call("PUT", path, lambda: self.fs.pipe_file(path, data))

    def remove(self, path: str) -> bool:
        """Delete one object; False when it was not there."""
        try:
            self.call("DELETE", path, lambda: self.fs.rm_file(path))
            return True
        except FileNotFoundError:
            return False

    def names(self) -> list[str] | None:
        """Names of the objects under the prefix, from a listing (it may miss objects written a
        moment ago), None when the prefix holds nothing."""

        def ls() -> list[str]:
            self.fs.invalidate_cache(self.root)
            return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.url, detail=False)]

        try:
            return self.call("LIST", self.url, ls)
        except FileNotFoundError:
            return None

    def check_bucket(self) -> None:
        """Raise :class:`StorageAccessError` when the bucket (or container) does not exist or cannot be
        reached: a save would otherwise fail only at its first upload, on every rank."""
        if self.protocol == "memory":
            return
        bucket = self.root.split("/", 1)[0]

        def probe() -> bool:
            if self.is_s3:  # HEAD bucket: raises what is wrong (no credentials, denied)
                try:
                    self.s3_call("head_bucket", Bucket=bucket)
                except FileNotFoundError:
                    return False
                return True
            self.fs.invalidate_cache(bucket)
            return bool(self.fs.exists(bucket))

        if not self.call("HEAD", bucket, probe):
            raise refused("HEAD", self.url, FileNotFoundError(f"no bucket {bucket}"))

    # -- streams --------------------------------------------------------------------------------------

    def open_read(self, path: str, size: int | None = None, known: ObjectSizes | None = None) -> RangedObjectFile:
        """A read stream of one object; ``known``: sizes asked for, shared between openings (one HEAD per
        object, on first need)."""
        return RangedObjectFile(self, path, size, known)

    def open_write(self, path: str, part_bytes: int | None = None, in_flight: int = 4) -> Any:
        """A write-only stream for one object: multipart upload with parts in flight on S3, fsspec's
        file elsewhere (the object appears when the stream closes)."""
        if self.is_s3:
            return MultipartObjectWriter(self, path, part_bytes, in_flight)
        return self.call("OPEN", path, lambda: self.fs.open(path, "wb"))

    def abort_uploads(self, keep: set[str]) -> list[str]:
        """Abort multipart uploads under the prefix left by saves that died (their parts are invisible
        but stored and billed), except uploads of objects in ``keep``. Returns the keys aborted."""
        if not self.is_s3:
            return []
        bucket, _, prefix = self.root.partition("/")
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        out = self.call("LIST", self.url, lambda: self.s3_call("list_multipart_uploads", Bucket=bucket, Prefix=prefix))
        aborted = []
        for up in out.get("Uploads", []) or []:
            key = up["Key"]
            if key.rsplit("/", 1)[-1] in keep:
                continue
            self.call("DELETE", f"s3://{bucket}/{key}", _abort(self, bucket, key, up["UploadId"]))
            aborted.append(key)
        return aborted

    def s3_call(self, method: str, **kwargs: Any) -> Any:
        """One S3 API call through s3fs's client (its session, retries and error translation)."""
        return s3_call(self.fs, method, **kwargs)


def _abort(store: ObjectStore, bucket: str, key: str, upload_id: str) -> Callable[[], Any]:
    return lambda: store.s3_call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
