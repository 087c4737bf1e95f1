"""Run a function on N ranks of a process group from a test: ``run(fn, world_size, *args)``.

gloo runs (the CPU tests) go to a **session-scoped pool**: per world size, ``world_size`` persistent
worker processes, forked from a forkserver that has already imported torch, each with its gloo
default group initialized once. A test submits a picklable ``fn`` (a module-level function of a
test module) and its arguments; every rank runs ``fn(rank, world_size, *args)`` and ``run`` returns
the results of ranks 0..N-1. Splitting a test into many pytest items therefore costs no process
start-ups: a task costs a pickle, a barrier and the cleanup below.

Isolation between tasks on the same workers (everything a fresh process would have had):

* ``os.environ``, the working directory, ``sys.path``, warning filters, logger levels, torch's
  default dtype, grad mode and its global RNG state are restored after each task (the RNG is reset
  *before* each task to the state a fresh worker starts with);
* module state: the globals of every ``ucp_dcp`` and test module, and of a few torch modules that
  keep state (DCP's plan caches, which are class attributes of ``SavePlanner`` keyed by planner
  class; DCP's checkpoint daemon process; DTensor's RNG tracker; the state-dict patch set), are
  snapshotted before a task and restored after it: rebound names get their old objects back and
  dicts, lists and sets their old contents (so ucp_dcp's ``_CACHE`` plan cache and its side-group
  cache start empty, as in a fresh process). Class attributes of classes defined there likewise.
  :func:`patch` and :func:`setenv` make a task-scoped change explicit (also for objects outside
  those modules); the change is undone when the task ends;
* process groups (and so device meshes) a task created are destroyed after it, and DCP's
  checkpoint daemon (``async_save`` with ``AsyncCheckpointerType.PROCESS``) is stopped; hashed
  group names get a per-task salt so a group of the same ranks in a later task is a new group;
  memo caches (``lru_cache``) of torch.distributed, ucp_dcp and the test modules are emptied:
  DTensor's sharding caches would otherwise hand a later task an equal-comparing mesh of an earlier
  one, with destroyed groups;
* task output (stdout/stderr of every rank, fd level) goes to a log per worker; the part a task
  wrote is printed in the test's captured output, and is part of the error when the task fails.

Failures: a rank that raises reports its traceback; a rank that dies (its exit code) or a task that
does not finish within ``timeout`` (the stacks of the ranks still running, dumped by faulthandler)
make ``run`` raise ``AssertionError`` with every rank's report, and the pool is torn down (its
process groups killed, children included) and started afresh for the next test, so one failure
does not cascade.

Other backends (the GPU tier's ``nccl``, ``cpu:gloo,cuda:nccl``) run in fresh processes per call, as
does everything when ``UCP_TEST_POOL=0``.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import types
from datetime import timedelta
from multiprocessing.connection import wait as _wait
from typing import Any, Callable

PG_TIMEOUT = timedelta(seconds=180)
"""Collective timeout of the workers' gloo groups."""
MAX_POOLED_PROCESSES = 12
"""Pools of other world sizes are closed (least recently used first) beyond this many workers."""
START_TIMEOUT = 180.0
GRACE_S = 1.0
"""After a rank fails, how long to wait for the other ranks' reports before the pool is killed."""

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TESTS = os.path.dirname(os.path.abspath(__file__))
_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp", "ucp_dcp"]
_STATEFUL_TORCH_MODULES = (
    "torch.distributed.checkpoint.planner",  # SavePlanner._cached_* plan caches (per planner class name)
    "torch.distributed.checkpoint._async_process_executor",  # _CHECKPOINT_PROCESS
    "torch.distributed.checkpoint.state_dict",  # _patched_state_dict
    "torch.distributed.tensor._random",  # _rng_tracker
)

_CTX = None


def _ctx():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")


# == inside a worker: task-scoped changes =============================================================

_UNDO: list[Callable[[], None]] | None = None  # None: not inside a task
_MISSING = object()


def patch(target: Any, name: str, value: Any) -> None:
    """``setattr(target, name, value)`` for the rest of the current task (a module global, a class
    attribute, ...): undone when the task ends, like pytest's ``monkeypatch`` in a test."""
    if _UNDO is None:
        raise RuntimeError("dist.patch is for code running as a task on the workers; tests use monkeypatch")
    old = target.__dict__.get(name, _MISSING) if hasattr(target, "__dict__") else getattr(target, name, _MISSING)
    _UNDO.append(lambda: delattr(target, name) if old is _MISSING else setattr(target, name, old))
    setattr(target, name, value)


def setenv(name: str, value: str | None) -> None:
    """Set (or with ``None`` remove) an environment variable for the rest of the current task."""
    if _UNDO is None:
        raise RuntimeError("dist.setenv is for code running as a task on the workers; tests use monkeypatch")
    old = os.environ.get(name)
    _UNDO.append(lambda: os.environ.pop(name, None) if old is None else os.environ.__setitem__(name, old))
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


# == inside a worker: snapshot and restore ============================================================

def _container_copy(v: Any) -> Any:
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, list):
        return list(v)
    if isinstance(v, set):
        return set(v)
    return None


def _container_changed(v: Any, old: Any) -> bool:
    if len(v) != len(old):
        return True
    if isinstance(v, dict):
        return any(v.get(k, _MISSING) is not x for k, x in old.items())
    if isinstance(v, list):
        return any(a is not b for a, b in zip(v, old))
    return v != old


def _restore_container(v: Any, old: Any) -> None:
    if not _container_changed(v, old):
        return
    if isinstance(v, list):
        v[:] = old
    else:
        v.clear()
        v.update(old)


def _tracked(name: str, mod: Any) -> bool:
    if mod is None or mod is sys.modules.get(__name__):  # not this module: it runs the task
        return False
    if name == "ucp_dcp" or name.startswith("ucp_dcp.") or name in _STATEFUL_TORCH_MODULES:
        return True
    path = getattr(mod, "__file__", None)
    return bool(path) and os.path.dirname(os.path.abspath(path)) == _TESTS  # test modules and helpers


class _ModuleState:
    """Globals of the tracked modules and attributes of the classes they define: identities and
    the contents of dicts, lists and sets."""

    def __init__(self) -> None:
        self.modules = []
        for name, mod in list(sys.modules.items()):
            if not _tracked(name, mod):
                continue
            ns = vars(mod)
            classes = []
            for v in list(ns.values()):
                if isinstance(v, type) and v.__module__ == mod.__name__:
                    attrs = {k: (a, _container_copy(a)) for k, a in vars(v).items()}
                    classes.append((v, attrs))
            self.modules.append((ns, {k: (v, _container_copy(v)) for k, v in ns.items()}, classes))

    def restore(self) -> None:
        for ns, saved, classes in self.modules:
            for k in [k for k in ns if k not in saved and not isinstance(ns[k], types.ModuleType)]:
                del ns[k]  # (a submodule imported meanwhile stays: sys.modules keeps it too)
            for k, (v, contents) in saved.items():
                if ns.get(k, _MISSING) is not v:
                    ns[k] = v
                if contents is not None:
                    _restore_container(v, contents)
            for cls, attrs in classes:
                now = vars(cls)
                for k in [k for k in now if k not in attrs]:
                    delattr(cls, k)
                for k, (v, contents) in attrs.items():
                    if now.get(k, _MISSING) is not v:
                        setattr(cls, k, v)
                    if contents is not None:
                        _restore_container(v, contents)


def _stop_checkpoint_daemon() -> None:
    """DCP's ``async_save`` PROCESS mode keeps a daemon (with its own process group, made from the
    task's group) for later saves: stop it, as the end of a fresh process would."""
    mod = sys.modules.get("torch.distributed.checkpoint._async_process_executor")
    proc = getattr(mod, "_CHECKPOINT_PROCESS", None) if mod else None
    if proc is None:
        return
    mod._CHECKPOINT_PROCESS = None
    sp = proc._save_process
    if sp.is_alive():
        try:
            proc._send(mod._CheckpointSaveProcessControlOpts.TERMINATE)
            sp.join(timeout=10)
        finally:
            if sp.is_alive():
                sp.kill()
                sp.join(timeout=10)


def _clear_memo(v: Any) -> None:
    if isinstance(v, functools._lru_cache_wrapper) or type(v).__name__ == "LocalLRUCache":
        v.cache_clear()


def _clear_caches() -> None:
    """Empty the memo caches (``functools.lru_cache``, DTensor's sharding-propagation caches, Python
    and C++, module dicts named ``*cache*`` in torch.distributed) of torch.distributed, ucp_dcp and the test modules. DTensor's are keyed by specs whose DeviceMesh
    compares equal across tasks (mesh equality ignores process groups): a result cached by an earlier
    task would hand back that task's mesh, whose groups are gone. A fresh process starts with them empty."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (looking at deprecated module attributes warns)
        for name, mod in list(sys.modules.items()):
            in_torch = name.startswith("torch.distributed")
            if mod is None or not (in_torch or _tracked(name, mod)):
                continue
            for k, v in list(vars(mod).items()):
                _clear_memo(v)
                if in_torch and isinstance(v, dict) and "cache" in k.lower():  # e.g. _redistribute._planner_cache
                    v.clear()
                if isinstance(v, type) and v.__module__ == name:
                    for a in list(vars(v).values()):
                        _clear_memo(getattr(a, "__func__", a))
    import torch

    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's
    if clear_native is not None:
        clear_native()
    dtensor = sys.modules.get("torch.distributed.tensor._api")
    propagator = getattr(getattr(getattr(dtensor, "DTensor", None), "_op_dispatcher", None), "sharding_propagator", None)
    for v in list(vars(propagator).values()) if propagator is not None else ():
        _clear_memo(v)


class _Task:
    """What a task may change in a worker, taken before it runs; :meth:`restore` puts it back."""

    def __init__(self) -> None:
        import logging

        import torch
        import torch.distributed.distributed_c10d as c10d

        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        self.path = list(sys.path)
        self.dtype = torch.get_default_dtype()
        self.grad = torch.is_grad_enabled()
        self.levels = {name: lg.level for name, lg in logging.root.manager.loggerDict.items()
                       if isinstance(lg, logging.Logger)}
        self.root_level = logging.root.level
        self.groups = set(c10d._world.pg_names)
        self.modules = _ModuleState()

    def restore(self) -> None:
        import logging

        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        _stop_checkpoint_daemon()
        for pg in reversed([pg for pg in list(c10d._world.pg_names) if pg not in self.groups]):
            dist.destroy_process_group(pg)
        while _UNDO:
            _UNDO.pop()()
        self.modules.restore()
        _clear_caches()
        if dict(os.environ) != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        sys.path[:] = self.path
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(self.grad)
        for name, lg in list(logging.root.manager.loggerDict.items()):
            if isinstance(lg, logging.Logger) and lg.level != self.levels.get(name, logging.NOTSET):
                lg.setLevel(self.levels.get(name, logging.NOTSET))
        if logging.root.level != self.root_level:
            logging.root.setLevel(self.root_level)


_SALT = [0]
_RNG0 = None


def _prepare_worker() -> None:
    """Once per worker: import every ucp_dcp module (so each is tracked from the first task on),
    salt hashed process-group names per task, keep the fresh RNG state."""
    global _RNG0
    import importlib
    import pkgutil

    import torch
    import torch.distributed.distributed_c10d as c10d
    import ucp_dcp

    for m in pkgutil.iter_modules(ucp_dcp.__path__):
        if m.name not in ("__main__", "torchtitan"):
            try:
                importlib.import_module(f"ucp_dcp.{m.name}")
            except Exception:  # a module that cannot be imported here fails in the task that uses it
                pass
    for name in _STATEFUL_TORCH_MODULES:
        importlib.import_module(name)
    unsalted = c10d._hash_ranks_to_str

    def salted(ranks):  # the same task number on every rank: members agree on the name
        return f"{unsalted(ranks)}-t{_SALT[0]}"

    c10d._hash_ranks_to_str = salted
    _RNG0 = torch.get_rng_state()


def _run_task(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, pooled: bool) -> tuple[bool, Any]:
    """Run one task on this rank: ``(True, pickled result)`` or ``(False, traceback text)``. After a
    failure nothing is cleaned up: the pool is killed."""
    global _UNDO
    import warnings

    import torch
    import torch.distributed as dist

    state = _Task() if pooled else None
    _UNDO = []
    try:
        if _RNG0 is not None:
            torch.set_rng_state(_RNG0)
        with warnings.catch_warnings():
            result = fn(rank, world_size, *args)
            dist.barrier()  # every rank is done with the task's collectives before groups go away
    except BaseException:
        return False, traceback.format_exc()
    try:
        if state is not None:
            state.restore()
        else:
            while _UNDO:
                _UNDO.pop()()
        _UNDO = None
        return True, pickle.dumps(result)
    except BaseException:
        return False, "after the task (cleanup, or pickling its result):\n" + traceback.format_exc()


def _flush() -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass


def _pool_worker(rank: int, world_size: int, port: int, conn, log: str) -> None:
    """A pool worker: init the gloo group once, then run tasks until told to stop."""
    import faulthandler

    try:
        os.setpgid(0, 0)  # the pool kills the process group: children (DCP's daemon, ...) included
    except OSError:
        pass
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks for the stacks of a hung rank
    os.environ.update(_rank_env(rank, world_size, port))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=PG_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=PG_TIMEOUT)
        _prepare_worker()
        conn.send_bytes(pickle.dumps((0, True, None)))
    except BaseException:
        _flush()
        conn.send_bytes(pickle.dumps((0, False, "worker start-up failed:\n" + traceback.format_exc())))
        os._exit(1)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        task_id, blob = pickle.loads(data)
        if blob is None:
            break
        _SALT[0] = task_id
        try:
            fn, args = pickle.loads(blob)
        except BaseException:
            ok, payload = False, "could not unpickle the task:\n" + traceback.format_exc()
        else:
            ok, payload = _run_task(fn, rank, world_size, args, pooled=True)
        _flush()
        try:
            conn.send_bytes(pickle.dumps((task_id, ok, payload)))
        except (EOFError, OSError):
            break
    _flush()
    os._exit(0)  # no interpreter teardown (torch 2.13 can abort there after all work succeeded)


# == the driver: pools ===================================================================================

class _Pool:
    """``world_size`` workers with a gloo group; :meth:`run` runs one task on all of them."""

    def __init__(self, world_size: int) -> None:
        import torch.distributed as dist

        self.world_size = world_size
        self.task = 0
        self.dir = tempfile.mkdtemp(prefix=f"ucp-pool{world_size}-")
        # the rendezvous store lives here: its port is taken atomically (no free-port race)
        self.store = dist.TCPStore(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False,
                                   timeout=PG_TIMEOUT)
        ctx = _ctx()
        self.logs = [os.path.join(self.dir, f"rank{r}.log") for r in range(world_size)]
        self.procs, self.conns = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_pool_worker, args=(r, world_size, self.store.port, child, self.logs[r]),
                            name=f"ucp-pool{world_size}-rank{r}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        ok, results, failures = self._collect(0, START_TIMEOUT, [0] * world_size)
        if not ok:
            self.close()
            raise AssertionError(f"the {world_size}-process pool did not start:\n{failures}")

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)  # (closed: no processes)

    def _tail(self, r: int, offset: int, limit: int = 6000) -> str:
        try:
            with open(self.logs[r], "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return text if len(text) <= limit else "[...]\n" + text[-limit:]

    def _collect(self, task_id: int, timeout: float, offsets: list[int]) -> tuple[bool, list[Any], str]:
        pending = dict(enumerate(self.conns))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace = None
        while pending:
            end = deadline if grace is None else min(deadline, grace)
            left = end - time.monotonic()
            if left <= 0:
                break
            waiting = list(pending.values()) + [self.procs[r].sentinel for r in pending]
            for obj in _wait(waiting, timeout=left):
                r = next((r for r, c in pending.items() if c is obj or self.procs[r].sentinel == obj), None)
                if r is None:
                    continue
                conn = pending.pop(r)
                try:
                    got_id, ok, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):  # the pipe closed: the process is gone
                    self.procs[r].join(timeout=5)
                    failures[r] = f"the process died (exit code {self.procs[r].exitcode})"
                    continue
                if got_id != task_id:
                    failures[r] = f"answered task {got_id}, expected {task_id}"
                elif not ok:
                    failures[r] = payload
                else:
                    try:
                        results[r] = None if payload is None else pickle.loads(payload)
                    except BaseException:
                        failures[r] = "its result could not be unpickled here:\n" + traceback.format_exc()
            if failures and grace is None:
                grace = time.monotonic() + GRACE_S
        if not failures and not pending:
            return True, [results[r] for r in range(self.world_size)], ""
        if pending and not failures:  # a hang: what every rank still running is doing
            for r in pending:
                try:
                    os.kill(self.procs[r].pid, signal.SIGUSR1)
                except OSError:
                    pass
            time.sleep(1.0)
            for r in pending:
                failures[r] = f"no result after {timeout:.0f}s: hung; its stacks are in its output below"
        parts = []
        for r in range(self.world_size):
            if r in failures:
                status = failures[r]
            elif r in pending:
                status = "still running when another rank failed (killed)"
            else:
                status = "finished"
            out = self._tail(r, offsets[r])
            parts.append(f"--- rank {r}: {status}" + (f"\n--- rank {r} output:\n{out}" if out.strip() else ""))
        return False, [], "\n".join(parts)

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[Any]:
        blob = pickle.dumps((fn, args))  # a task that cannot be pickled fails here, the pool untouched
        self.task += 1
        offsets = []
        for log in self.logs:
            try:
                offsets.append(os.path.getsize(log))
            except OSError:
                offsets.append(0)
        msg = pickle.dumps((self.task, blob))
        try:
            for conn in self.conns:
                conn.send_bytes(msg)
        except (OSError, EOFError) as e:
            self.close()
            raise AssertionError(f"distributed run failed: the {self.world_size}-process pool is gone ({e})") from None
        ok, results, report = self._collect(self.task, timeout, offsets)
        if not ok:
            self.close()
            name = getattr(fn, "__qualname__", repr(fn))
            raise AssertionError(f"distributed run of {name} on {self.world_size} ranks failed:\n{report}")
        for r in range(self.world_size):  # into the test's captured output (shown when it fails)
            out = self._tail(r, offsets[r])
            if out.strip():
                print(f"--- rank {r} output:\n{out}", file=sys.stderr)
        return results

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the worker leads its own process group
                except OSError:
                    pass
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        self.store = None
        shutil.rmtree(self.dir, ignore_errors=True)


_POOLS: dict[int, _Pool] = {}  # least recently used first


def pool(world_size: int) -> _Pool:
    """The pool of ``world_size`` workers, started (or restarted after a failure) when needed."""
    p = _POOLS.pop(world_size, None)
    if p is not None and not p.alive():
        p.close()
        p = None
    if p is None:
        while _POOLS and sum(x.world_size for x in _POOLS.values()) + world_size > MAX_POOLED_PROCESSES:
            _POOLS.pop(next(iter(_POOLS))).close()
        p = _Pool(world_size)
    _POOLS[world_size] = p
    return p


@atexit.register
def shutdown() -> None:
    """Stop every pool (the session fixture calls this at the end of the run)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def use_pool(backend: str) -> bool:
    return backend == "gloo" and os.environ.get("UCP_TEST_POOL", "1") != "0"


# == fresh processes (other backends, or UCP_TEST_POOL=0) ================================================

def _worker(fn, rank, world_size, port, queue, args, backend="gloo"):
    os.environ.update(_rank_env(rank, world_size, port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if "nccl" in backend:  # NCCL needs the rank's device before the first collective
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=PG_TIMEOUT)
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
        return
    ok, payload = _run_task(fn, rank, world_size, args, pooled=False)
    if ok:
        dist.destroy_process_group()
    queue.put((rank, ok, payload))


def _run_fresh(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, backend: str) -> list[Any]:
    ctx = _ctx()
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, queue, args, backend)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    import queue as q

    try:
        while len(results) + len(failures) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except q.Empty:
                failures[-1] = f"timed out after {timeout}s waiting for ranks"
                break
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                break
    finally:
        for p in procs:
            if failures:
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures.items())
        raise AssertionError(f"distributed run failed:\n{text}")
    return [results[r] for r in range(world_size)]


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600, backend: str = "gloo") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks (process group ``backend``);
    return their results, rank 0 first. gloo runs go to the session's pool of workers (see the
    module docstring); ``fn`` and ``args`` must pickle (a module-level function)."""
    if use_pool(backend):
        return pool(world_size).run(fn, args, timeout)
    return _run_fresh(fn, world_size, args, timeout, backend)


_TMPDIRS: list[str] = []


def tmpdir() -> str:
    """A scratch folder for one run's checkpoints, removed when the test process exits."""
    d = tempfile.mkdtemp(prefix="ucp-test-")
    _TMPDIRS.append(d)
    return d


@atexit.register
def _remove_tmpdirs() -> None:
    for d in _TMPDIRS:
        shutil.rmtree(d, ignore_errors=True)
