"""Promotion layer for engines that do not bring their own (vLLM has one: TieringOffloadingManager).

During a scheduler step an engine calls :meth:`Promoter.lookup` and :meth:`Promoter.promote` for
its requests; at the step's end :meth:`Promoter.on_step_end` submits **one load job per request**
(one io_uring submission each). A block needed by several requests is read once: the first
request's job reads it, later ones wait for it and get the slot it lands in, and every lookup of
it answers HIT_PENDING until it has landed. A block whose load failed is MISS from then on (the
tier remembers the failure), so an engine recomputes it instead of retrying forever.

Slots are the tier's arena's: host memory, or GPU memory when the arena is a CUDA tensor (the
loads then land in device slots by the tier's device path, see :mod:`pykvtier.gpu`).

Thread rules: as :class:`~pykvtier.tier.DiskTier` (one thread at a time).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .tier import DiskTier, JobResult, LookupResult, TransferJob, _as_key

__all__ = ["Promoter", "PromotionResult"]

_JOB_BASE = 1 << 48  # job ids of the promoter's loads, apart from the caller's own


@dataclass
class PromotionResult:
    """All loads a request asked for have settled.

    ``loaded``: key -> arena slot holding its bytes (for a block shared with an earlier request,
    the slot that request gave). ``failed``: key -> reason; a key whose block failed to load is
    MISS from now on (a key that was not a HIT when it was asked, e.g. RETRY while a shared
    tier's probe was in flight, may be a HIT later).
    """

    request_id: Hashable
    loaded: dict[bytes, int] = field(default_factory=dict)
    failed: dict[bytes, str] = field(default_factory=dict)


class Promoter:
    """Batches a step's promotions per request over a :class:`DiskTier` (see module docs).

    The promoter collects the tier's finished jobs: its own loads become
    :class:`PromotionResult`\\ s from :meth:`poll`; other jobs (the caller's stores) are kept for
    :meth:`take_other_results`.
    """

    def __init__(self, tier: DiskTier) -> None:
        self.tier = tier
        self._gathered: dict[Hashable, list[tuple[bytes, int]]] = {}
        self._landing: dict[bytes, int] = {}  # key gathered or being read -> its slot
        self._waiters: dict[bytes, list[Hashable]] = {}
        self._outstanding: dict[Hashable, int] = {}  # request -> keys not settled yet
        self._results: dict[Hashable, PromotionResult] = {}
        self._jobs: dict[int, list[bytes]] = {}
        self._next_job = _JOB_BASE
        self._other: list[JobResult] = []
        self.jobs_submitted = 0

    def lookup(self, key: bytes) -> LookupResult:
        """As :meth:`DiskTier.lookup`, and HIT_PENDING for a block already asked for this step."""
        if _as_key(key) in self._landing:
            return LookupResult.HIT_PENDING
        return self.tier.lookup(key)

    def promote(self, request_id: Hashable, keys: Sequence[bytes], slot_ids: Sequence[int]) -> dict[bytes, int]:
        """Asks for ``keys`` to be loaded into ``slot_ids`` for ``request_id`` at step end.

        Returns key -> the slot the block will land in: the given one, or, for a block another
        request already asked for, that request's slot (it is read once). Raises ValueError if
        the lengths differ."""
        if len(keys) != len(slot_ids):
            raise ValueError(f"{len(keys)} keys but {len(slot_ids)} slot_ids")
        where: dict[bytes, int] = {}
        if not keys:
            return where
        result = self._results.setdefault(request_id, PromotionResult(request_id))
        for key, slot in zip(keys, slot_ids):
            key = _as_key(key)
            if key in where or key in result.loaded:
                continue
            if key not in self._landing:
                self._landing[key] = int(slot)
                self._gathered.setdefault(request_id, []).append((key, int(slot)))
            where[key] = self._landing[key]
            self._waiters.setdefault(key, []).append(request_id)
            self._outstanding[request_id] = self._outstanding.get(request_id, 0) + 1
        return where

    def on_step_end(self) -> None:
        """Submits one load job per request for the blocks gathered this step, then ends the
        tier's step (existence probes)."""
        for items in self._gathered.values():
            job_id = self._next_job
            self._next_job += 1
            keys = [k for k, _ in items]
            self._jobs[job_id] = keys
            self.tier.submit_load(TransferJob(job_id, keys, [s for _, s in items]))
            self.jobs_submitted += 1
        self._gathered.clear()
        self.tier.on_step_end()

    def poll(self) -> list[PromotionResult]:
        """Requests whose promotions all settled since the last call. Never blocks."""
        return self._collect(self.tier.get_finished_jobs())

    def wait(self, timeout_s: float | None = None) -> list[PromotionResult]:
        """As :meth:`poll`, blocking until some job finished (or timeout_s seconds)."""
        return self._collect(self.tier.wait(timeout_s))

    def take_other_results(self) -> list[JobResult]:
        """Finished jobs that were not the promoter's (e.g. the caller's stores)."""
        out, self._other = self._other, []
        return out

    @property
    def in_flight(self) -> int:
        """Requests with promotions not yet settled."""
        return len(self._outstanding)

    def _collect(self, finished: list[JobResult]) -> list[PromotionResult]:
        done: list[PromotionResult] = []
        for jr in finished:
            keys = self._jobs.pop(jr.job_id, None)
            if keys is None:
                self._other.append(jr)
                continue
            for key in keys:
                slot = self._landing.pop(key)
                reason = jr.failed_keys.get(key)
                for rid in self._waiters.pop(key):
                    res = self._results[rid]
                    if reason is None:
                        res.loaded[key] = slot
                    else:
                        res.failed[key] = reason
                    self._outstanding[rid] -= 1
                    if self._outstanding[rid] == 0:
                        del self._outstanding[rid]
                        done.append(self._results.pop(rid))
        return done
