"""A rank's error as the bytes a failure header carries to the ranks waiting for data from it.

JSON (module, class name, first line of the message), never a pickle: the receiving rank rebuilds the
cause's class only from ``ucp_dcp`` and ``builtins`` (anything else is a plain ``UCPError`` cause) and
raises it as a :class:`~ucp_dcp.errors.PeerFailedError` naming the sender.
"""

from __future__ import annotations

import json

from ..errors import PeerFailedError, UCPError, _build, _first_line, _lookup, _peer_class

__all__ = ["wire", "from_wire"]


def wire(exc: BaseException) -> bytes:
    """``exc`` as the bytes a failure header carries to the ranks waiting for this one."""
    cls = type(exc)
    if isinstance(exc, PeerFailedError):  # pass the root cause on, not "a peer failed"
        base = next((b for b in cls.__mro__[1:] if not issubclass(b, PeerFailedError)), UCPError)
        return json.dumps(
            {"module": base.__module__, "cls": base.__qualname__, "msg": str(exc), "rank": exc.rank}
        ).encode()
    msg = exc.message if isinstance(exc, UCPError) else str(exc)
    return json.dumps({"module": cls.__module__, "cls": cls.__qualname__, "msg": _first_line(msg)}).encode()


def from_wire(src: int, data: bytes) -> PeerFailedError:
    """The error a rank raises for the failure ``src`` sent (``data`` from :func:`wire`)."""
    try:
        d = json.loads(bytes(data).decode())
        cls = _lookup(str(d["module"]), str(d["cls"]))
        if "rank" in d:  # src forwarded another rank's failure
            return _build(_peer_class(cls), int(d["rank"]), str(d["msg"]), {})
        text = f"rank {src} failed: {cls.__name__}: {d['msg']}"
    except (ValueError, KeyError, TypeError):
        cls, text = UCPError, f"rank {src} failed reading checkpoint data this rank needs (see its errors)"
    return _build(_peer_class(cls), src, text, {"hint": f"rank {src} reports the cause in full"})
