"""Promotion layer for engines that do not bring their own (vLLM has one: TieringOffloadingManager).

During a scheduler step an engine calls :meth:`Promoter.lookup` and :meth:`Promoter.promote` for
its requests; at the step's end :meth:`Promoter.on_step_end` submits **one load job per request**
(one io_uring submission each). A block needed by several requests is read once: the first
request's job reads it, later ones wait for it and get the slot it lands in, and every lookup of
it answers HIT_PENDING until it has landed. A block whose load failed is MISS from then on (the
tier remembers the failure), so an engine recomputes it instead of retrying forever.

Slots are the tier's arena's: host memory, or GPU memory when the arena is a CUDA tensor (the
loads then land in device slots by the tier's device path, see :mod:`pykvtier.gpu`).

Load or recompute (``bypass="auto"``, off by default; docs/design.md "Load or recompute"):
:meth:`Promoter.lookup_prefix` answers a request's blocks in prompt order and, of the leading
run of hits, answers MISS from block ``k`` on, ``k`` =
:func:`pykvtier.costmodel.loadable_prefix` of the tier's measured load bandwidth (a
:class:`~pykvtier.costmodel.BandwidthEstimate` fed by the promoter's finished loads), the bytes
queued ahead (blocks asked for or being read, and hits answered this step not yet promoted,
other than the request's own)
and the blocks' recompute seconds (a :class:`~pykvtier.costmodel.PrefillModel`). The blocks
answered MISS so are counted (``stats()["bypassed_hits"]``).

Thread rules: as :class:`~pykvtier.tier.DiskTier` (one thread at a time).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .costmodel import BandwidthEstimate, PrefillModel, loadable_prefix
from .tier import DiskTier, JobResult, LookupResult, TransferJob, _as_key

__all__ = ["Promoter", "PromotionResult"]

_JOB_BASE = 1 << 48  # job ids of the promoter's loads, apart from the caller's own
_HITS = (LookupResult.HIT, LookupResult.HIT_PENDING)
BYPASS_MODES = (None, "off", "auto")


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

    ``bypass``: None or ``"off"`` (default: :meth:`lookup_prefix` answers as :meth:`lookup`), or
    ``"auto"`` (load only the prefix of hits that loads faster than it recomputes; module docs),
    which needs ``prefill`` (a :class:`~pykvtier.costmodel.PrefillModel`). ``tokens_per_block``:
    the tokens of one block (default: the tier's block bytes / the model's KV bytes per token,
    which must divide it). ``bandwidth``: the load bandwidth estimate (default: a
    :class:`~pykvtier.costmodel.BandwidthEstimate` with no initial figure: every hit is loaded
    until a load has been measured). ValueError for a bad ``bypass`` or a missing or
    mismatched model.
    """

    def __init__(self, tier: DiskTier, *, bypass: str | None = None,
                 prefill: PrefillModel | None = None, tokens_per_block: int | None = None,
                 bandwidth: BandwidthEstimate | None = None) -> None:
        if bypass not in BYPASS_MODES:
            raise ValueError(f"Promoter: bypass must be None, \"off\" or \"auto\", got {bypass!r}")
        self.bypass = bypass == "auto"
        self.prefill = prefill
        self.bandwidth = bandwidth
        self.tokens_per_block = tokens_per_block
        if self.bypass:
            if not isinstance(prefill, PrefillModel):
                raise ValueError("Promoter: bypass=\"auto\" needs prefill, a "
                                 f"pykvtier.costmodel.PrefillModel, got {prefill!r}")
            per_token = prefill.model.kv_bytes_per_token
            if tokens_per_block is None:
                if tier.block_size_bytes % per_token:
                    raise ValueError(
                        f"Promoter: the tier's {tier.block_size_bytes}-byte blocks are no whole "
                        f"number of {prefill.model.name} tokens ({per_token} B each): pass "
                        "tokens_per_block")
                self.tokens_per_block = tier.block_size_bytes // per_token
            elif isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) \
                    or tokens_per_block < 1:
                raise ValueError(f"Promoter: tokens_per_block must be a positive integer, got "
                                 f"{tokens_per_block!r}")
            if self.bandwidth is None:
                self.bandwidth = BandwidthEstimate()
        self._answered: set[bytes] = set()  # hits lookup_prefix answered this step, not promoted
        self.bypassed_hits = 0  # hits lookup_prefix answered MISS (bypass="auto")
        self.bypassed_requests = 0  # lookup_prefix calls that answered some hit MISS
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

    def lookup_prefix(self, keys: Sequence[bytes], start_token: int = 0) -> list[LookupResult]:
        """One request's lookups: ``keys`` are its blocks in prompt order, ``keys[i]`` holding
        tokens ``start_token + i * tokens_per_block`` onwards. Returns :meth:`lookup`'s answer
        for each key, except, with ``bypass="auto"``, that the leading run of hits (HIT or
        HIT_PENDING) answers MISS from block ``k`` on: ``k = loadable_prefix(hits,
        tier.block_size_bytes, queued, bandwidth.bytes_per_s, recompute)`` with ``queued`` the
        bytes of the blocks asked for or being read and of the hits answered this step and not
        promoted yet, other than this request's own hits, ``recompute`` each hit's
        ``prefill.block_seconds``; no estimate yet: every
        hit is loaded. Hits after the run are left as they are (the prefix an engine loads ends
        at the first block that is not a hit). The blocks answered MISS so are counted
        (``bypassed_hits``)."""
        answers = [self.lookup(k) for k in keys]
        if not self.bypass:
            return answers
        hits = 0
        while hits < len(answers) and answers[hits] in _HITS:
            hits += 1
        bw = self.bandwidth.bytes_per_s
        k = hits
        if hits and bw:
            block = self.tier.block_size_bytes
            # Ahead of this request: the blocks being read or answered, less its own (its own
            # are its load, k * block below; counted twice, a request asked again in the step,
            # or whose promotion is on its way, answered MISS for the blocks it loads).
            own = {_as_key(x) for x in keys[:hits]}
            mine = sum(1 for x in own if x in self._landing or x in self._answered)
            queued = block * (len(self._landing) + len(self._answered.difference(self._landing))
                              - mine)
            recompute = self.prefill.blocks_seconds(start_token, self.tokens_per_block, hits)
            k = loadable_prefix(hits, block, queued, bw, recompute)
        for i in range(k, hits):
            answers[i] = LookupResult.MISS
        if k < hits:
            self.bypassed_hits += hits - k
            self.bypassed_requests += 1
        self._answered.update(_as_key(x) for x in keys[:k])
        return answers

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
            self._answered.discard(key)
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
        self._answered.clear()
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

    def stats(self) -> dict[str, int]:
        """The promoter's counters: ``jobs_submitted``, ``bypassed_hits`` (hits
        :meth:`lookup_prefix` answered MISS: loading them would have been slower than
        recomputing), ``bypassed_requests`` (its calls that did), ``bandwidth_loads`` (finished
        loads the bandwidth estimate took)."""
        return {"jobs_submitted": self.jobs_submitted, "bypassed_hits": self.bypassed_hits,
                "bypassed_requests": self.bypassed_requests,
                "bandwidth_loads": self.bandwidth.loads if self.bandwidth is not None else 0}

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
            if self.bandwidth is not None and jr.transfer_bytes and jr.transfer_time:
                self.bandwidth.update(jr.transfer_bytes, jr.transfer_time)
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
