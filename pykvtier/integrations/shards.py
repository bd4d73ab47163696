"""The tiers of an adapter's roots, driven from an engine's many threads.

An engine calls its storage backend from several threads at once (LMCache: the caller's thread,
its event loop's, vLLM's workers). :class:`DiskTier` is single-threaded, so :class:`Shards` makes
every DiskTier call holding its one lock (``cv``), and none of those calls waits on the disk; a
thread waiting for its jobs waits on the condition with the lock released, while one collector
thread per root waits on that root's engine (GIL released) and hands finished jobs to their
callers, or runs their completion callback (outside the lock). A key's root is chosen from its
block's digest. See docs/design.md, "LMCache".
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..layout import key_digest
from ..tier import DiskTier, JobResult, LookupResult, TransferJob

__all__ = ["Shards"]

logger = logging.getLogger("pykvtier")

_COLLECT_WAIT_S = 0.05  # a collector's engine wait, before it looks at the lock again
_PROBE_POLL_S = 0.001  # settle(): how often it looks at its probes
_PROBE_WAIT_S = 5.0  # ... and for how long at most (then unanswered keys count as absent)


class _Call:
    """The engine jobs of one submit(), and their results as the collectors hand them out."""

    __slots__ = ("left", "results", "sent", "keys", "on_done", "is_load", "claimed")

    def __init__(self, keys: Sequence[bytes], on_done: Callable[[dict[bytes, bool]], None] | None,
                 is_load: bool):
        self.left = 0
        self.results: list[JobResult] = []
        self.sent: dict[int, list[bytes]] = {}  # job id -> its keys
        self.keys = keys
        self.on_done = on_done
        self.is_load = is_load
        self.claimed = b""  # the slots claimed across roots (Shards.claims), as int64 rows

    def outcome(self) -> dict[bytes, bool]:
        """Block key -> success (a key of no job, e.g. a refused one, False)."""
        ok = dict.fromkeys(self.keys, False)
        for r in self.results:
            done = r.successful_keys if r.successful_keys is not None else (
                self.sent[r.job_id] if r.success else ())
            for k in done:
                ok[k] = True
        return ok


class Shards:
    """DiskTiers (one per root, sharing one arena) behind one lock, with collector threads.

    ``cv``: the lock (a Condition) every DiskTier call is made under; callers of :meth:`lookup`
    and :meth:`settle` hold it (an adapter may pass its own, to guard its state with it too).
    ``name``: the adapter's name, for the log and thread names. ``claims``: where several roots
    share one arena whose jobs may name the same slots (SGLang's host pool), a
    ``_native.SlotClaims`` over its slots: a call's slots are claimed across the roots, as one
    DiskTier claims its own, until its jobs finished (two loads into a slot, or a store from a
    slot a load fills, would race in it); a call whose slots are taken fails, logged.
    """

    def __init__(self, tiers: list[DiskTier], name: str, *, cv: threading.Condition | None = None,
                 claims: Any = None) -> None:
        self.tiers = tiers
        self.name = name
        self.cv = cv if cv is not None else threading.Condition(threading.Lock())
        self.claims = claims
        self.closing = False
        self._pausing = 0  # paused() blocks in progress: new submits wait
        self._job_ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}  # job id -> its call
        self._inflight = [0] * len(tiers)  # jobs per root
        self._collectors = [threading.Thread(target=self._collect, args=(i,), daemon=True,
                                             name=f"pykvtier-{name}-collector-{i}")
                            for i in range(len(tiers))]
        for t in self._collectors:
            t.start()

    def shard(self, digest: bytes) -> int:
        """The root of the block whose key digest is ``digest``."""
        return int.from_bytes(digest[:8], "little") % len(self.tiers)

    def lookup(self, bkeys: Sequence[bytes]) -> list[LookupResult]:
        """The tiers' answers for block keys ``bkeys`` (call holding ``cv``)."""
        if len(self.tiers) == 1:
            look = self.tiers[0].lookup
            return [look(k) for k in bkeys]
        out = []
        for k in bkeys:
            d = key_digest(k)
            out.append(self.tiers[self.shard(d)].lookup_digest(d))
        return out

    def settle(self, bkeys: Sequence[bytes], answers: list[LookupResult]) -> list[LookupResult]:
        """The answers of shared roots once the probes of their RETRY keys completed: submits
        them (one batch per root), then waits on the condition, the lock released, looking
        again each ms until those probes are applied, for at most 5 s; a key still RETRY then
        (e.g. being written) stays RETRY. Call holding ``cv``."""
        for t in self.tiers:
            t.on_step_end()  # submits the probes the lookups asked for; never waits
        deadline = time.monotonic() + _PROBE_WAIT_S
        while LookupResult.RETRY in answers and not self.closing:
            if not any(t.probes_in_flight for t in self.tiers) or time.monotonic() > deadline:
                break
            self.cv.wait(_PROBE_POLL_S)  # (lock released: other threads go on meanwhile)
            if self.closing:
                break
            for t in self.tiers:
                t.apply_probes()
            retry = [i for i, a in enumerate(answers) if a is LookupResult.RETRY]
            for i, a in zip(retry, self.lookup([bkeys[i] for i in retry])):
                answers[i] = a
        return answers

    def tier_of(self, bkey: bytes) -> tuple[DiskTier, bytes]:
        """The tier of block key ``bkey`` and its digest."""
        d = key_digest(bkey)
        return self.tiers[self.shard(d)], d

    def submit(self, bkeys: Sequence[bytes], slots: Sequence[int], is_load: bool,
               on_done: Callable[[dict[bytes, bool]], None] | None = None) -> _Call:
        """Submits the jobs (one per root) moving blocks ``bkeys`` to/from arena ``slots``;
        returns the handle :meth:`wait` takes, or with ``on_done`` calls ``on_done(block key
        -> success)`` once, from a collector thread (outside the lock), when they finished (at
        once, on this thread, when nothing was submitted). A job a tier refuses (ValueError:
        a slot in use by another job) fails its keys, logged; so do all of them when their
        slots are claimed by another call (``claims``). Waits while :meth:`paused`. Call without
        holding ``cv``."""
        call = _Call(bkeys, on_done, is_load)
        parts: dict[int, tuple[list[bytes], list[int], list[bytes] | None]] = {}
        if len(self.tiers) == 1:
            parts[0] = (list(bkeys), list(slots), None)  # the tier digests the keys, in C++
        else:
            for k, s in zip(bkeys, slots):
                d = key_digest(k)
                ks, ss, ds = parts.setdefault(self.shard(d), ([], [], []))
                ks.append(k)
                ss.append(s)
                ds.append(d)
        with self.cv:
            self.cv.wait_for(lambda: not self._pausing or self.closing)
            if not self.closing and self.claims is not None:
                rows = np.asarray(slots, np.int64).tobytes()
                try:
                    self.claims.claim(next(self._job_ids), rows, is_load)
                    call.claimed = rows
                except ValueError as exc:
                    logger.warning("pykvtier: %s %s of %d blocks refused: %s", self.name,
                                   "load" if is_load else "store", len(bkeys), exc)
                    parts.clear()
            if not self.closing:
                for shard, (ks, ss, ds) in parts.items():
                    jid = next(self._job_ids)
                    tier = self.tiers[shard]
                    try:
                        (tier.submit_load if is_load else tier.submit_store)(TransferJob(jid, ks, ss), ds)
                    except (ValueError, RuntimeError) as exc:
                        logger.warning("pykvtier: %s %s of %d blocks refused: %s", self.name,
                                       "load" if is_load else "store", len(ks), exc)
                        continue
                    call.left += 1
                    call.sent[jid] = ks
                    self._calls[jid] = call
                    self._inflight[shard] += 1
                self.cv.notify_all()  # wakes the collectors
            if call.left == 0:
                self._release(call)
        if call.left == 0 and on_done is not None:
            on_done(call.outcome())
        return call

    def wait(self, call: _Call) -> dict[bytes, bool]:
        """Waits (on the condition, the lock released) until the jobs of ``call`` finished:
        block key -> success."""
        with self.cv:
            self.cv.wait_for(lambda: call.left == 0)
        return call.outcome()

    def _release(self, call: _Call) -> None:
        """The call's claims given back (holding ``cv``; its jobs finished)."""
        if call.claimed:
            self.claims.release(call.claimed, call.is_load)
            call.claimed = b""

    def idle(self) -> bool:
        """No job in flight (call holding ``cv``)."""
        return not any(self._inflight)

    def loading_blocks(self) -> int:
        """Blocks of the load jobs in flight: submitted, their results not yet handed out by a
        collector (call holding ``cv``). The queue ahead of a new load (``bypass: auto``)."""
        return sum(len(call.sent[jid]) for jid, call in self._calls.items() if call.is_load)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Holding ``cv``, once no job is in flight; new submits wait until the block ends (an
        adapter replaces ``tiers[i]`` there, e.g. SGLang's clear())."""
        with self.cv:
            self._pausing += 1
            try:
                self.cv.wait_for(self.idle)
                yield
            finally:
                self._pausing -= 1
                self.cv.notify_all()

    def drain(self) -> None:
        """Waits until no job is in flight (their callbacks run)."""
        with self.cv:
            self.cv.wait_for(self.idle)

    def close(self) -> None:
        """Drains, stops the collectors and shuts the tiers down. Idempotent."""
        with self.cv:
            if self.closing:
                return
            self.cv.wait_for(self.idle)
            self.closing = True
            self.cv.notify_all()
        for t in self._collectors:
            if t is not threading.current_thread():
                t.join()
        with self.cv:
            for t in self.tiers:
                t.shutdown()

    def _collect(self, shard: int) -> None:
        """Collector thread of one root: waits on its engine (GIL released, no lock), then
        hands the finished jobs to their callers."""
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self._inflight[shard] > 0 or self.closing)
                if self._inflight[shard] == 0:
                    return  # closing, nothing left in flight
                tier = self.tiers[shard]
                engine = tier.engine
            got = engine.wait(_COLLECT_WAIT_S)
            done: list[_Call] = []
            ours = 0
            with self.cv:
                results = tier.get_finished_jobs()
                for r in results:
                    call = self._calls.pop(r.job_id, None)
                    if call is None:
                        continue
                    ours += 1
                    call.results.append(r)
                    call.left -= 1
                    if call.left == 0:
                        self._release(call)
                        if call.on_done is not None:
                            done.append(call)
                if ours:
                    self.cv.notify_all()  # wakes wait()
                if not done:
                    self._inflight[shard] -= ours
                if not results and not got and engine.pending_jobs() == 0:
                    # The tier holds the job back (a store waiting on its evictions' follow-up):
                    # look again shortly rather than spin.
                    self.cv.wait(_COLLECT_WAIT_S / 10)
            if done:
                for call in done:  # outside the lock: callbacks may call back into the adapter
                    try:
                        call.on_done(call.outcome())
                    except Exception:  # a callback's bug must not stop the collector
                        logger.exception("pykvtier: %s completion callback failed", self.name)
                with self.cv:  # only now idle(): drain() returns after the callbacks ran
                    self._inflight[shard] -= ours
                    self.cv.notify_all()
