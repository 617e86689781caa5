"""Resource samples of the children (CPU %, RSS, USS), read off the main loop.

A pass may cover only `limit` children in turn while nobody looks at the
figures. See docs/supervisor.md ("Status").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import psutil

from supervisor.runtime.children import Child

USS_PER_PASS = 25
USS_BUDGET_S = 0.05


@dataclass(frozen=True)
class Sample:
    cpu_percent: float
    rss_bytes: int
    uss_bytes: int | None  # None: not read in this pass (the last figure stands)


class Sampler:
    """One pass over some pids; psutil handles cached per pid (cpu_percent
    measures since the previous call on the same handle)."""

    def __init__(self, uss_per_pass: int = USS_PER_PASS, uss_budget_s: float = USS_BUDGET_S,
                 ) -> None:
        self._procs: dict[int, psutil.Process] = {}
        self._uss_known: set[int] = set()
        self._uss_per_pass = uss_per_pass
        self._uss_budget_s = uss_budget_s
        self._cursor = 0
        self._turn = 0  # where the next limited pass starts

    def sample(self, pids: Sequence[int], with_uss: bool = True,
               limit: int | None = None) -> dict[int, Sample]:
        """CPU and RSS of each pid (of `limit` of them in turn, when given);
        USS of some (none when `with_uss` is False)."""
        live = set(pids)
        for pid in [p for p in self._procs if p not in live]:
            del self._procs[pid]
        self._uss_known &= live
        if limit is not None and limit < len(pids):
            start = self._turn % len(pids)
            self._turn = start + limit
            pids = [*pids[start:start + limit], *pids[:max(0, start + limit - len(pids))]]
        turn = self._uss_turn(pids) if with_uss else []
        spent = 0.0
        out: dict[int, Sample] = {}
        for pid in pids:
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = psutil.Process(pid)
                    self._procs[pid] = proc
                    proc.cpu_percent(None)  # primes the counter; the next call is real
                    cpu = 0.0
                else:
                    cpu = round(proc.cpu_percent(None), 1)
                uss: int | None = None
                if pid in turn and spent < self._uss_budget_s:
                    t0 = time.perf_counter()
                    info = proc.memory_full_info()
                    spent += time.perf_counter() - t0
                    rss, uss = int(info.rss), int(info.uss)
                    self._uss_known.add(pid)
                else:
                    rss = int(proc.memory_info().rss)
            except (psutil.Error, OSError):
                self._procs.pop(pid, None)
                continue
            out[pid] = Sample(cpu, rss, uss)
        return out

    def _uss_turn(self, pids: Sequence[int]) -> list[int]:
        """The pids whose USS this pass reads, in order: never read first."""
        turn = [p for p in pids if p not in self._uss_known][: self._uss_per_pass]
        left = self._uss_per_pass - len(turn)
        if pids and left > 0:
            start = self._cursor % len(pids)
            order = [*pids[start:], *pids[:start]]
            turn += [p for p in order[:left] if p not in turn]
            self._cursor = start + left
        return turn


def apply_samples(children: Iterable[Child], samples: dict[int, Sample]) -> None:
    """Copy each sample to the child that still has its pid."""
    for child in children:
        got = samples.get(child.pid) if child.pid is not None else None
        if got is None:
            continue
        child.cpu_percent = got.cpu_percent
        child.rss_bytes = got.rss_bytes
        if got.uss_bytes is not None:
            child.uss_bytes = got.uss_bytes


class SamplerThread:
    """A Sampler on a daemon thread: `submit` the pids to sample, `take` what
    the passes finished since the last take (the newest figure per pid)."""

    def __init__(self, sampler: Sampler | None = None) -> None:
        self._sampler = sampler or Sampler()
        self._cond = threading.Condition()
        self._want: tuple[int, ...] | None = None
        self._uss = True
        self._limit: int | None = None
        self._done: dict[int, Sample] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def submit(self, pids: Iterable[int], *, uss: bool = True, limit: int | None = None) -> None:
        """Sample `pids` next (`uss` False: no USS read in that pass; `limit`:
        only that many of them, in turn)."""
        if not self._thread.is_alive() and not self._closed:
            self._thread.start()  # on the first pass
        with self._cond:
            self._want = tuple(pids)
            self._uss = uss
            self._limit = limit
            self._cond.notify()

    def take(self) -> dict[int, Sample]:
        with self._cond:
            done, self._done = self._done, {}
        return done

    def close(self, timeout_s: float = 2.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._want is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                pids, self._want, uss, limit = self._want, None, self._uss, self._limit
            assert pids is not None
            got = self._sampler.sample(pids, uss, limit)
            with self._cond:
                self._done.update(got)
