"""Run a test body in N processes forming a torch.distributed group (gloo on CPU, NCCL on GPUs).

Each rank calls ``fn(rank, world_size, *args)``; an exception in any rank fails the test with
that rank's traceback. Used by tests/test_distributed.py.

:func:`run_ranks` starts a fresh group for one body; :class:`RankPool` starts one group of
ranks and runs several tests' bodies on it in turn (each process imports torch, Triton and
shardmax once instead of once per test: a few CPU-seconds per rank and test). A pool whose body
failed on any rank, hung or lost a rank is killed; the next body starts a fresh pool.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(
    rank: int,
    world_size: int,
    backend: str,
    init_file: str,
    err_dir: str,
    fn: Callable[..., None],
    args: tuple[Any, ...],
) -> None:
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        try:
            fn(rank, world_size, *args)
        finally:
            dist.barrier()
            dist.destroy_process_group()
        # the rank's checks passed and its group is gone: what follows is interpreter shutdown
        Path(err_dir, f"done{rank}").touch()
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(
    fn: Callable[..., None], world_size: int, backend: str, *args: Any, timeout: float = 600.0
) -> None:
    """Spawn ``world_size`` ranks running ``fn``; raise AssertionError with rank tracebacks, or
    after ``timeout`` seconds (a rank left behind in a collective: the ranks are killed)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        try:
            ctx = mp.spawn(
                _worker,
                args=(world_size, backend, init_file, tmp, fn, args),
                nprocs=world_size,
                join=False,
            )
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:
                        if proc.is_alive():
                            proc.kill()
                    raise AssertionError(
                        f"ranks still running after {timeout:.0f} s: a rank was left behind in "
                        "a collective (hang)"
                    )
        except AssertionError:
            raise
        except mp.ProcessExitedException as e:
            done = all(Path(tmp, f"done{r}").exists() for r in range(world_size))
            if not (done and e.signal_name):
                logs = [
                    Path(tmp, p).read_text()
                    for p in sorted(os.listdir(tmp))
                    if p.startswith("rank")
                ]
                raise AssertionError("\n".join(logs) or str(e)) from e
            # every rank finished its checks and tore its group down, then one died by a signal
            # at interpreter shutdown (seen once under load: gloo's "terminate called without an
            # active exception"): not what the test checks
            warnings.warn(
                f"a rank died at shutdown after passing: {e}", UserWarning, stacklevel=2
            )  # shown in the warnings summary, not fatal (pyproject.toml's filterwarnings)
            for proc in ctx.processes:
                proc.join(timeout=30)
        except Exception as e:
            logs = [
                Path(tmp, p).read_text() for p in sorted(os.listdir(tmp)) if p.startswith("rank")
            ]
            raise AssertionError("\n".join(logs) or str(e)) from e


def _pool_worker(
    rank: int, world_size: int, backend: str, init_file: str, tasks: Any, results: Any
) -> None:
    """One rank of a :class:`RankPool`: joins the group once, then runs the bodies it is sent.
    After a body, a barrier (as :func:`run_ranks`' end of the group): a body that left the ranks'
    collectives unpaired hangs or fails there, and the pool is discarded."""
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        n, fn, args = task
        try:
            fn(rank, world_size, *args)
            dist.barrier()
        except BaseException:
            results.put((n, rank, traceback.format_exc()))
            return  # the group's state is unknown: the parent kills this pool
        results.put((n, rank, ""))
    dist.barrier()
    dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned ranks of one gloo group, reused by several tests' bodies.

    :meth:`run` is :func:`run_ranks` on this group: every rank calls ``fn(rank, world_size,
    *args)``; a rank's exception fails the call with that rank's traceback, a rank still busy
    after ``timeout`` seconds (left behind in a collective) or a rank that died fails it too.
    After any failure the pool is killed (:attr:`alive` is False)."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory()
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self._results = ctx.Queue()
        init_file = os.path.join(self._tmp.name, "init")
        self._procs = [
            ctx.Process(
                target=_pool_worker,
                args=(r, world_size, backend, init_file, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._n = 0
        self.alive = True

    def run(self, fn: Callable[..., None], *args: Any, timeout: float = 600.0) -> None:
        assert self.alive, "a failed pool runs nothing"
        self._n += 1
        for q in self._tasks:
            q.put((self._n, fn, args))
        done: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(done) < self.world_size:
            try:
                n, rank, err = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self.close(kill=True)
                    raise AssertionError(f"rank(s) {dead} died") from None
                if time.monotonic() > deadline:
                    self.close(kill=True)
                    raise AssertionError(
                        f"ranks still running after {timeout:.0f} s: a rank was left behind in "
                        "a collective (hang)"
                    ) from None
                continue
            assert n == self._n, (n, self._n)  # a failed call kills the pool: never stale
            if err:
                self.close(kill=True)
                raise AssertionError(f"rank {rank}:\n{err}")
            done.add(rank)

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (``kill``: at once, else after their group's last barrier)."""
        if not kill and self.alive:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=60)
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=30)
        self.alive = False
        self._tmp.cleanup()


class RankPools:
    """One live :class:`RankPool` per world size, started on first use (a module's fixture)."""

    def __init__(self, backend: str = "gloo") -> None:
        self.backend = backend
        self._pools: dict[int, RankPool] = {}

    def run(
        self, fn: Callable[..., None], world_size: int, *args: Any, timeout: float = 600.0
    ) -> None:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = RankPool(world_size, self.backend)
        pool.run(fn, *args, timeout=timeout)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
