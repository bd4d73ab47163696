"""Load or recompute (``bypass: auto``) for the adapters whose lookups are prefix counts.

SGLang's ``HiCacheStorage.batch_exists`` and LMCache's ``batched_contains`` answer the number of
leading keys of a request that are stored; with ``bypass`` ``"auto"`` (off by default) the
adapter answers fewer: the ``k`` of :func:`pykvtier.costmodel.loadable_prefix`, the prefix of
the hits whose load, behind the bytes already queued, ends no later than the GPU would have
recomputed those tokens (docs/design.md, "Load or recompute"). The engine then loads those and
recomputes the rest, as for any miss.

This module holds what the adapters share: the option texts (:func:`bypass_docs`, for the five
``bypass*`` fields each adapter's options dataclass declares, so that the README's tables list
them), :func:`check_bypass` (the options' checks, ValueError naming the option, for every adapter)
and :class:`PrefixBypass` (the decision, the bandwidth estimate, the counters). It imports no
engine.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

from ..costmodel import GPU_PRESETS, BandwidthEstimate, PrefillModel, get_gpu, loadable_prefix
from ..models import PRESETS, get_preset
from ..tier import JobResult

__all__ = ["BYPASS_MODES", "PrefixBypass", "bypass_docs", "check_bypass"]

BYPASS_MODES = ("off", "auto")


def bypass_docs(what: str, parallel: str) -> dict[str, str]:
    """README text of the five bypass options of an adapter whose lookups answer ``what``
    (e.g. "pages") missing, its tensor-parallel size being ``parallel``."""
    models = ", ".join(f"`{n}`" for n in PRESETS if n != "tiny")
    gpus = ", ".join(f"`{n}`" for n in GPU_PRESETS)
    return {
        "bypass": f"`auto`: a request loads only the prefix of its {what} that loads no slower "
                  "than the GPU recomputes it; the rest answer missing, counted "
                  f"(`stats()[\"bypassed_hits\"]`; see \"Load or recompute\"); `off`: all the "
                  f"stored {what} count",
        "bypass_model": f"model preset of the recompute estimate: {models}; required with "
                        "`bypass: auto`",
        "bypass_gpu": f"GPU preset of the recompute estimate ({gpus}: peak dense bf16 FLOP/s), "
                      f"times {parallel}",
        "bypass_mfu": "model FLOPs utilization of the recompute estimate, in (0, 1]",
        "bypass_bytes_per_s": "load bandwidth (bytes/s) assumed until a load has been measured "
                              "(then a moving estimate of the finished loads, half-life 5 s); "
                              "`null`: every hit loads until then",
    }


def _real(v: Any) -> bool:
    """A real number (int, float, a numpy scalar, Fraction), not a bool."""
    return not isinstance(v, bool) and isinstance(v, numbers.Real)


def _as_float(v: Any) -> float:
    """``float(v)`` of a real number; an int too large for a float is ``inf`` (not
    OverflowError)."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def check_bypass(opts: Any) -> None:
    """The bypass options of an adapter's options dataclass ``opts`` (its ``_bad`` makes the
    ValueError, prefixed with the adapter's name): ``bypass`` "off" or "auto" (false, as YAML
    1.1 reads a bare ``off``, is "off"); ``bypass_gpu`` a GPU preset; ``bypass_mfu`` a real
    number in (0, 1]; ``bypass_bytes_per_s`` null or a finite real number > 0 (numpy scalars
    included; both stored as floats); ``bypass_model`` a model preset with a prefill estimate,
    required with "auto". ``opts`` may be frozen: the normalized values are set in place."""
    set_ = object.__setattr__.__get__(opts)
    if opts.bypass is False:  # LMCache's yaml.safe_load (YAML 1.1) reads `bypass: off` so
        set_("bypass", "off")
    if not isinstance(opts.bypass, str) or opts.bypass not in BYPASS_MODES:
        hint = (" (YAML reads a bare on/yes/true as true: write \"auto\")"
                if opts.bypass is True else "")
        raise opts._bad(f"bypass must be \"off\" or \"auto\", got {opts.bypass!r}{hint}")
    try:
        get_gpu(opts.bypass_gpu)
    except ValueError as exc:
        raise opts._bad(f"bypass_gpu: {exc}") from None
    m = opts.bypass_mfu
    if not _real(m) or not 0 < _as_float(m) <= 1:  # (NaN fails the comparison)
        raise opts._bad(f"bypass_mfu must be a number in (0, 1], got {m!r}")
    set_("bypass_mfu", float(m))
    w = opts.bypass_bytes_per_s
    if w is not None:
        f = _as_float(w) if _real(w) else math.nan
        if not (math.isfinite(f) and f > 0):
            raise opts._bad(f"bypass_bytes_per_s must be null or a positive number (bytes/s), "
                            f"got {w!r}")
        set_("bypass_bytes_per_s", f)
    if opts.bypass_model is None:
        if opts.bypass == "auto":
            raise opts._bad("bypass: auto needs bypass_model, the model preset of the "
                            f"recompute estimate ({', '.join(n for n in PRESETS if n != 'tiny')})")
        return
    try:
        PrefillModel(get_preset(opts.bypass_model), opts.bypass_gpu, opts.bypass_mfu)
    except ValueError as exc:
        raise opts._bad(f"bypass_model: {exc}") from None


class PrefixBypass:
    """``bypass: auto`` over one adapter's prefix lookups: :meth:`cap` answers how many of a
    request's leading hits to report, :meth:`measured` feeds the bandwidth estimate with
    finished loads. ``opts``: the adapter's checked options; ``gpus``: the tensor-parallel
    size the prefill is split over. Not thread-safe: call holding the adapter's lock.

    Counters (the vLLM adapter's names): ``bypassed_hits``, hits answered missing because
    recomputing them is faster; ``bypassed_requests``, the :meth:`cap` calls that did so."""

    def __init__(self, opts: Any, gpus: int) -> None:
        self.prefill = PrefillModel(get_preset(opts.bypass_model), opts.bypass_gpu,
                                    float(opts.bypass_mfu), gpus=max(1, int(gpus)))
        self.bandwidth = BandwidthEstimate(opts.bypass_bytes_per_s)
        self.bypassed_hits = 0
        self.bypassed_requests = 0

    def cap(self, hits: int, block_bytes: int, tokens_per_block: int, start_token: int,
            queued_bytes: int) -> int:
        """Of ``hits`` leading stored blocks of ``block_bytes`` bytes and ``tokens_per_block``
        tokens each, the first at token ``start_token``, ``queued_bytes`` of loads ahead: the
        ``k`` of :func:`~pykvtier.costmodel.loadable_prefix` on their
        :meth:`~pykvtier.costmodel.PrefillModel.blocks_seconds`, at the bandwidth estimate
        (none yet: ``hits``, every hit loads and is measured). Counts ``hits - k``."""
        bw = self.bandwidth.bytes_per_s
        if hits <= 0 or not bw:
            return hits
        recompute = self.prefill.blocks_seconds(start_token, tokens_per_block, hits)
        k = loadable_prefix(hits, block_bytes, queued_bytes, bw, recompute)
        if k < hits:
            self.bypassed_hits += hits - k
            self.bypassed_requests += 1
        return k

    def measured(self, results: Iterable[JobResult]) -> None:
        """One finished load (its jobs' results, one per root, run side by side): the bytes
        summed over the jobs, over the longest job's transfer time."""
        results = list(results)
        nbytes = sum(r.transfer_bytes or 0 for r in results)
        seconds = max((r.transfer_time or 0.0 for r in results), default=0.0)
        if nbytes and seconds:
            self.bandwidth.update(nbytes, seconds)

    def stats(self) -> dict[str, int]:
        return {"bypassed_hits": self.bypassed_hits, "bypassed_requests": self.bypassed_requests}
