"""The worker side of the pool of gloo workers (:mod:`dist`): what runs inside a worker process.

A task's changes are scoped (:func:`patch`, :func:`setenv`), and everything a task may change --
environment, working directory, ``sys.path``, module globals of ucp_dcp, ucp_dev and the test modules, process
groups, caches, logger levels, the RNG -- is snapshotted before it and restored after it
(:class:`_Task`); :func:`_pool_worker` is a pool worker's main loop, :func:`_worker` a fresh process's
(see :mod:`dist`'s docstring for the isolation rules). Neither this module nor :mod:`dist` is tracked:
their globals (the undo list, the per-task salt) belong to the worker, not the task.
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import sys
import traceback
import types
from collections.abc import Callable
from datetime import timedelta
from typing import Any

PG_TIMEOUT = timedelta(seconds=180)
"""Collective timeout of the workers' gloo groups."""
_PACKAGES = ("ucp_dcp", "ucp_dev")
"""Tracked packages: the library and the checkout's development package (dev/: the toy model, the fixtures)."""
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The tests/ folder: modules under it (test modules and support) are tracked."""
_STATEFUL_TORCH_MODULES = (
    "torch.distributed.checkpoint.planner",  # SavePlanner._cached_* plan caches (per planner class name)
    "torch.distributed.checkpoint._async_process_executor",  # _CHECKPOINT_PROCESS
    "torch.distributed.checkpoint.state_dict",  # _patched_state_dict
    "torch.distributed.tensor._random",  # _rng_tracker
)


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )


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


_CONTAINERS = (dict, list, set)


def _container_copy(v: Any) -> Any:
    if not isinstance(v, _CONTAINERS):  # (most globals: one check)
        return None
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, list):
        return list(v)
    return set(v)


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


_TRACKED: dict[tuple[str, int], bool] = {}
"""``_tracked``'s answers by module name and object: asked for every module twice a task, and a path lookup
per module cost each task tens of milliseconds per rank."""


def _tracked(name: str, mod: Any) -> bool:
    key = (name, id(mod))
    got = _TRACKED.get(key)
    if got is None:
        got = _TRACKED[key] = _is_tracked(name, mod)
    return got


def _is_tracked(name: str, mod: Any) -> bool:
    if mod is None or getattr(mod, "__name__", None) in (__name__, "dist"):  # not these: they run the task
        return False
    if name.split(".")[0] in _PACKAGES or name in _STATEFUL_TORCH_MODULES:
        return True
    path = getattr(mod, "__file__", None)
    return bool(path) and os.path.abspath(path).startswith(_TESTS + os.sep)  # test modules and support


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
    and C++, module dicts named ``*cache*`` in torch.distributed) of torch.distributed, ucp_dcp, ucp_dev and the test modules. DTensor's are keyed by specs whose DeviceMesh
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
    propagator = getattr(
        getattr(getattr(dtensor, "DTensor", None), "_op_dispatcher", None), "sharding_propagator", None
    )
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
        self.levels = {
            name: lg.level for name, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger)
        }
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
    """Once per worker: import every ucp_dcp and ucp_dev module (so each is tracked from the first task on),
    salt hashed process-group names per task, keep the fresh RNG state."""
    global _RNG0
    import importlib
    import pkgutil

    import torch
    import torch.distributed.distributed_c10d as c10d

    import ucp_dcp
    import ucp_dev

    todo = [("ucp_dcp", ucp_dcp.__path__), ("ucp_dev", ucp_dev.__path__)]
    while todo:  # the subpackages' modules too; not those that import torchtitan (the integration, its CPU jobs)
        pkg, path = todo.pop()
        for m in pkgutil.iter_modules(path):
            name = f"{pkg}.{m.name}"
            if name in ("ucp_dcp.__main__", "ucp_dcp.torchtitan", "ucp_dev.testing.titan"):
                continue
            try:
                mod = importlib.import_module(name)
            except Exception:  # a module that cannot be imported here fails in the task that uses it
                continue
            if m.ispkg:
                todo.append((name, mod.__path__))
    for name in _STATEFUL_TORCH_MODULES:
        importlib.import_module(name)
    unsalted = c10d._hash_ranks_to_str

    def salted(ranks):  # the same task number on every rank: members agree on the name
        return f"{unsalted(ranks)}-t{_SALT[0]}"

    c10d._hash_ranks_to_str = salted
    _RNG0 = torch.get_rng_state()


def _check_group_count() -> None:
    """Raise if the ranks now disagree on c10d's count of sequentially named groups: a task that made a
    group on some ranks only (``DeviceMesh("cpu", ranks)`` over a subset, ``new_group`` called by its members
    alone) leaves every later task's ``new_group`` naming the same group differently on different ranks,
    so its members wait for each other at different store prefixes until the timeout (a hang of a later,
    innocent test). A fresh process per test would hide the mistake; the pool makes it show here."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([c10d._world.group_count]))
    got = [int(c) for c in counts]
    if len(set(got)) > 1:
        raise RuntimeError(
            f"the task left c10d's group counts differing between ranks ({got}): it created a process group "
            "(new_group, or a DeviceMesh over some ranks) that not every rank created; every rank must call "
            "new_group, or build a subset's mesh with DeviceMesh.from_group"
        )


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
            if pooled:  # (a fresh process ends after this task: nothing of it reaches another)
                _check_group_count()
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
