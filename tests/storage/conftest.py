"""The S3-compatible server the object-store tests use: moto's, on 127.0.0.1, started once per session."""

import os
import uuid

import pytest

BUCKET = "ucp-tests"


@pytest.fixture(scope="session")
def s3_server():
    """A running :class:`~ucp_dcp.testing.s3_server.S3Server` with bucket :data:`BUCKET`; this process's
    AWS settings point at it for the session (the pool's workers get them per task: :func:`s3_env`)."""
    from ucp_dcp.testing.s3_server import S3Server

    server = S3Server().start()
    server.create_bucket(BUCKET)
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def s3(s3_server):
    """The server with its faults off and counters reset, and a prefix of its own for this test."""
    s3_server.faults.clear()
    s3_server.prefix = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    yield s3_server
    s3_server.faults.clear()
