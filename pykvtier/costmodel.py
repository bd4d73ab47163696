"""Load or recompute: what a KV block costs to prefill, and how much of a request's hits to load.

A block found in the tier saves the GPU its prefill, but only if loading it is faster than
computing it again (IMPRESS, FAST'25: disk hits do not always cut the time to first token).
This module estimates both sides and picks, per request, the prefix of its hits to load. It is
library (the Promoter and the vLLM adapter use it for ``bypass="auto"``) and imports no engine.

**Prefill FLOPs** (:meth:`PrefillModel.block_flops`). The prompt tokens at positions
``s .. s+t-1`` (0-based), the KV of the tokens before ``s`` being cached, cost::

    flops(s, t) = 2 * N * t  +  4 * L * H * d * (t * s + t * (t + 1) / 2)

- ``N`` = :attr:`pykvtier.models.ModelPreset.dense_params` = ``params - embedding_params``: a
  token's forward pass is one multiply-add (2 FLOPs) per weight of the layers; the token
  embedding is a lookup, and the LM head runs on a prefill's last token only (vLLM samples
  from it), so neither is counted. Llama-3-8B: N = 6,979,588,096.
- The second term is attention's quadratic part: a token at position ``i`` attends to the
  ``i + 1`` positions up to itself (causal), and per layer and query head ``Q K^T`` and
  ``softmax(.) V`` are each ``d x (i + 1)`` multiply-adds, so ``2 x 2 x H x d x (i + 1)``
  FLOPs per layer; summed over ``i = s .. s+t-1``, ``sum (i + 1) = t*s + t*(t+1)/2``.
  ``L`` = ``num_layers``, ``H`` = ``num_q_heads``, ``d`` = ``head_dim``. (The counting of
  Kaplan et al. 2020, with both attention matmuls; norms, softmax and RoPE are left out.)

**Seconds** (:meth:`PrefillModel.block_seconds`): ``flops(s, t) / (gpus x bf16_flops x mfu)``,
the marginal compute of those tokens in a batched prefill step on ``gpus`` GPUs (tensor
parallel), at model FLOPs utilization ``mfu`` of the GPU's peak dense bf16 FLOP/s. The
weights' read from HBM is shared by the batch and not charged to a block
(:meth:`PrefillModel.step_floor_seconds` gives it). **Break-even bandwidth**
(:meth:`PrefillModel.break_even_bytes_per_s`): ``t x kv_bytes_per_token / block_seconds(s, t)``,
the load bandwidth at which reading those tokens' KV takes as long as computing it.

Worked example (tests/test_costmodel.py): Llama-3-8B, 16 tokens at position 0:
``2 x 6,979,588,096 x 16 + 4 x 32 x 32 x 128 x (16 x 0 + 136) = 223,346,819,072 + 71,303,168
= 223,418,122,240`` FLOPs; on an H100 (989.4e12 FLOP/s) at mfu 0.5, 451.6 us; its KV
(16 x 131,072 B = 2 MiB) breaks even at 4.64 GB/s.

**The rule** (:func:`loadable_prefix`). A request's lookups found ``hits`` consecutive blocks
(``B`` bytes each) in the tier; ``Q`` bytes of loads are queued ahead of its load; the tier
loads at ``W`` bytes/s; ``r[j]`` is block ``j``'s recompute seconds. It loads blocks
``0..k-1`` and recomputes the rest (the prefix stays contiguous: an engine computes the tokens
after what it loaded), with::

    k = the largest k in 1..hits with  (Q + k*B) / W  <=  r[0] + ... + r[k-1],  else 0

The left side is when the load of blocks ``0..k-1`` ends, behind the queued bytes (the tier
serves its queue in order); the right side is when the GPU would have recomputed them. Load,
then compute is how vLLM and SGLang run a hit (no overlap assumed), so the request's KV is
ready at ``load(k) + sum(r[k:hits])`` against ``sum(r[:hits])`` without the tier: a ``k``
that passes never makes the request later than recomputing, and the largest such ``k``
saves the most GPU time. ``k`` grows with ``W`` and shrinks with ``Q`` (each inequality only
gets easier with more bandwidth or fewer queued bytes).

Since ``r[j]`` grows along the prompt (attention), the answer is all or nothing in practice:
block ``j`` adds ``r[j] - B/W`` to the margin ``sum(r[:k]) - (Q + k*B)/W``, which starts at
``-Q/W <= 0``; with growing ``r[j]`` once the margin is >= 0 at some ``k`` it never falls
again, so ``k`` is ``hits`` when loading them all beats recomputing them, else 0; and if the
first block alone is worth loading (``(Q + B)/W <= r[0]``) all the hits are, however many
follow (the vLLM adapter answers at once then). A partial ``k`` needs recompute figures that
fall somewhere (a short last block). The overlap of Cake (ICML'25: compute the front of a
prefix while loading its back) needs the loaded part at the end, which the engines' prefix
contract (load blocks 0..k-1, compute the rest) cannot express.

**Bandwidth** (:class:`BandwidthEstimate`): the tier's finished loads, bytes over seconds,
each weighted by ``2 ** (-(age / half_life_s))``: a moving estimate that follows the drive
within a few half-lives. It is a per-job rate (a job's transfer time includes the time it
shared the drive with the jobs beside it), so with many small loads in flight it reads low
and the rule leans to recomputing; :class:`FixedBandwidth` pins a known figure instead.

Thread rules: none of these objects lock; use each from one thread at a time (as DiskTier).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Union

from .models import ModelPreset, get_preset

__all__ = [
    "GpuPreset",
    "GPU_PRESETS",
    "get_gpu",
    "PrefillModel",
    "BandwidthEstimate",
    "FixedBandwidth",
    "loadable_prefix",
]


@dataclass(frozen=True)
class GpuPreset:
    """A GPU's peak dense bf16 tensor FLOP/s (no sparsity) and its memory bandwidth (bytes/s),
    from the vendor's datasheet."""

    name: str
    bf16_flops: float  # peak dense bf16 tensor FLOP/s (no sparsity), from the vendor's datasheet
    hbm_bytes_per_s: float  # memory bandwidth, bytes/s (HBM; GDDR6 on the L40S)
    description: str = ""


#: The GPU presets, from NVIDIA's datasheets (the dense figure is half the "with sparsity" one
#: they print first):
#:
#: - ``h100``: H100 SXM5 80 GB, BF16 Tensor Core 1,979 TFLOPS with sparsity = 989.4e12 dense;
#:   HBM3 3.35 TB/s.
#: - ``h200``: H200 SXM 141 GB, BF16 1,979 TFLOPS with sparsity = 989.4e12 dense; HBM3e
#:   4.8 TB/s.
#: - ``a100``: A100 SXM4 80 GB, BF16 Tensor Core 312 TFLOPS dense (624 with sparsity); HBM2e
#:   2,039 GB/s.
#: - ``l40s``: L40S 48 GB, BF16 Tensor Core 362.05 TFLOPS dense (733 with sparsity); GDDR6
#:   864 GB/s.
GPU_PRESETS: dict[str, GpuPreset] = {
    g.name: g
    for g in (
        GpuPreset("h100", 989.4e12, 3.35e12, "NVIDIA H100 SXM5 80GB: 989.4 TFLOPS dense bf16, "
                                             "3.35 TB/s HBM3"),
        GpuPreset("h200", 989.4e12, 4.8e12, "NVIDIA H200 SXM 141GB: 989.4 TFLOPS dense bf16, "
                                            "4.8 TB/s HBM3e"),
        GpuPreset("a100", 312e12, 2.039e12, "NVIDIA A100 SXM4 80GB: 312 TFLOPS dense bf16, "
                                            "2.039 TB/s HBM2e"),
        GpuPreset("l40s", 362.05e12, 0.864e12, "NVIDIA L40S 48GB: 362.05 TFLOPS dense bf16, "
                                               "864 GB/s GDDR6"),
    )
}


def get_gpu(name: Union[str, GpuPreset]) -> GpuPreset:
    """A GPU preset by name (case-insensitive); a :class:`GpuPreset` is returned as is.
    ValueError naming the presets for any other name."""
    if isinstance(name, GpuPreset):
        return name
    found = GPU_PRESETS.get(str(name).strip().lower())
    if found is None:
        raise ValueError(f"unknown GPU preset {name!r}; known GPU presets: "
                         f"{', '.join(GPU_PRESETS)}")
    return found


def _count(what: str, v: object) -> int:
    """A token position or count: an int >= 0 (ValueError naming ``what`` else)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {v!r}")
    return v


def _number(what: str, v: object, *, positive: bool, allow_inf: bool = False) -> float:
    """A real number > 0 (``positive``) or >= 0, finite unless ``allow_inf``; ValueError else."""
    if isinstance(v, bool) or not isinstance(v, Real) or math.isnan(v) \
            or (math.isinf(v) and not allow_inf) or (v <= 0 if positive else v < 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{what} must be a number {bound}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class PrefillModel:
    """Prefill cost of prompt tokens for ``model`` on ``gpus`` x ``gpu`` at ``mfu`` (see the
    module docs for the formulas). ``model`` and ``gpu`` may be given by name (resolved by
    :func:`pykvtier.models.get_preset` and :func:`get_gpu`). ValueError at construction: an
    unknown name, ``mfu`` not in (0, 1], ``gpus`` not a positive integer, or a model preset
    without ``num_q_heads`` / ``params`` (naming it)."""

    model: ModelPreset
    gpu: GpuPreset
    mfu: float = 0.5  # model FLOPs utilization, in (0, 1]
    gpus: int = 1  # GPUs a prefill is split over (tensor parallel size)

    def __post_init__(self) -> None:
        set_ = object.__setattr__.__get__(self)  # (frozen: the normalized values go in once)
        set_("model", get_preset(self.model))
        set_("gpu", get_gpu(self.gpu))
        m = self.mfu
        if isinstance(m, bool) or not isinstance(m, Real) or not 0 < m <= 1:
            raise ValueError(f"mfu must be a number in (0, 1] (model FLOPs utilization), got {m!r}")
        set_("mfu", float(m))
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"gpus must be a positive integer, got {self.gpus!r}")
        p = self.model
        if p.num_q_heads <= 0:
            raise ValueError(f"model preset {p.name!r} has no num_q_heads: the prefill cost "
                             "model needs the model's query heads")
        if p.params <= 0 or not 0 <= p.embedding_params < p.params:
            raise ValueError(f"model preset {p.name!r} has no usable parameter count (params "
                             f"{p.params}, embedding_params {p.embedding_params}): the prefill "
                             "cost model needs both, params > embedding_params >= 0")

    @property
    def flops_per_s(self) -> float:
        """The FLOP/s a prefill gets: ``gpus x bf16_flops x mfu``."""
        return self.gpus * self.gpu.bf16_flops * self.mfu

    def block_flops(self, start_token: int, tokens: int) -> float:
        """Prefill FLOPs of the prompt tokens ``[start_token, start_token + tokens)``, the
        prefix before them cached: ``2 N t + 4 L H d (t s + t (t + 1) / 2)`` (module docs).
        0 for ``tokens`` 0. ValueError for a negative or non-integer position or count."""
        s = _count("start_token", start_token)
        t = _count("tokens", tokens)
        p = self.model
        attention = 4 * p.num_layers * p.num_q_heads * p.head_dim * (t * s + t * (t + 1) // 2)
        return float(2 * p.dense_params * t + attention)  # (exact in ints: t(t+1) is even)

    def block_seconds(self, start_token: int, tokens: int) -> float:
        """Seconds to prefill those tokens: ``block_flops / (gpus x bf16_flops x mfu)``."""
        return self.block_flops(start_token, tokens) / self.flops_per_s

    def prefix_seconds(self, tokens: int) -> float:
        """Seconds to prefill the prompt's tokens ``[0, tokens)``: ``block_seconds(0, tokens)``."""
        return self.block_seconds(0, tokens)

    def blocks_seconds(self, start_token: int, tokens_per_block: int, blocks: int) -> list[float]:
        """Recompute seconds of ``blocks`` consecutive blocks of ``tokens_per_block`` tokens,
        the first starting at ``start_token``: ``[block_seconds(start + j * tpb, tpb) ...]``
        (the ``recompute_seconds`` of :func:`loadable_prefix`)."""
        s = _count("start_token", start_token)
        tpb = _count("tokens_per_block", tokens_per_block)
        return [self.block_seconds(s + j * tpb, tpb) for j in range(_count("blocks", blocks))]

    def break_even_bytes_per_s(self, start_token: int, tokens: int) -> float:
        """The load bandwidth (bytes/s) at which reading the KV of those tokens
        (``tokens x model.kv_bytes_per_token`` bytes) takes as long as computing it: a tier
        slower than this loses to recomputing. ValueError for ``tokens`` 0."""
        if _count("tokens", tokens) == 0:
            raise ValueError("break_even_bytes_per_s needs tokens >= 1")
        return tokens * self.model.kv_bytes_per_token / self.block_seconds(start_token, tokens)

    def step_floor_seconds(self) -> float:
        """Seconds one forward pass takes at least to read the weights (bf16, 2 bytes each,
        embeddings included) from memory, split over ``gpus``: the floor under a prefill step
        of few tokens. Not part of :meth:`block_seconds`: a block is one part of a batched
        step, whose weight reads the batch shares."""
        return 2 * self.model.params / (self.gpus * self.gpu.hbm_bytes_per_s)


class BandwidthEstimate:
    """Moving estimate of a tier's load bandwidth (bytes/s) from finished loads.

    :meth:`update` takes one finished load (its payload bytes and transfer seconds, as a
    ``JobResult``'s ``transfer_bytes`` / ``transfer_time``); :attr:`bytes_per_s` is
    ``sum(w_i x bytes_i) / sum(w_i x seconds_i)`` over the loads so far, ``w_i = 2 **
    (-(now - now_i) / half_life_s)`` with ``now`` the latest update's time: a bytes-weighted
    mean rate that forgets a load in a few half-lives (``half_life_s`` may be ``math.inf``:
    all loads count alike). Before any load with bytes and seconds, it is
    ``initial_bytes_per_s`` (None: no estimate). Not thread-safe (one thread at a time).
    ValueError for an ``initial_bytes_per_s`` or ``half_life_s`` that is not a number > 0.
    """

    def __init__(self, initial_bytes_per_s: float | None = None, half_life_s: float = 5.0) -> None:
        self._initial = (None if initial_bytes_per_s is None else
                         _number("initial_bytes_per_s", initial_bytes_per_s, positive=True))
        self.half_life_s = _number("half_life_s", half_life_s, positive=True, allow_inf=True)
        self._bytes = 0.0  # decayed sums, as of self._last
        self._seconds = 0.0
        self._last: float | None = None
        self.loads = 0  # loads counted (with bytes and seconds)

    def update(self, nbytes: int, seconds: float, now: float | None = None) -> None:
        """One finished load of ``nbytes`` payload bytes in ``seconds``, at time ``now``
        (``time.monotonic()`` seconds; None: now). A load with no bytes or no time (refused
        before any I/O) is ignored. ValueError for a negative or non-finite figure."""
        b = _number("nbytes", nbytes, positive=False)
        s = _number("seconds", seconds, positive=False)
        if b == 0 or s == 0:
            return
        t = time.monotonic() if now is None else _number("now", now, positive=False)
        if self._last is not None and t > self._last and not math.isinf(self.half_life_s):
            decay = 0.5 ** ((t - self._last) / self.half_life_s)
            self._bytes *= decay
            self._seconds *= decay
        self._bytes += b
        self._seconds += s
        self._last = t if self._last is None else max(self._last, t)
        self.loads += 1

    @property
    def bytes_per_s(self) -> float | None:
        """The estimate (bytes/s), or ``initial_bytes_per_s`` before any load; None: none."""
        if self._seconds > 0:
            return self._bytes / self._seconds
        return self._initial


class FixedBandwidth(BandwidthEstimate):
    """A bandwidth known beforehand (bytes/s): :attr:`bytes_per_s` is always it; updates are
    counted (``loads``) and otherwise ignored. For a modeled disk, and for tests."""

    def __init__(self, bytes_per_s: float) -> None:
        super().__init__(bytes_per_s, math.inf)

    def update(self, nbytes: int, seconds: float, now: float | None = None) -> None:
        _number("nbytes", nbytes, positive=False)
        _number("seconds", seconds, positive=False)
        if nbytes and seconds:
            self.loads += 1

    @property
    def bytes_per_s(self) -> float:
        return self._initial  # type: ignore[return-value]


def loadable_prefix(hits: int, block_bytes: int, queued_bytes: int, bytes_per_s: float,
                    recompute_seconds: Sequence[float]) -> int:
    """How many of a request's ``hits`` leading blocks to load: ``k`` in ``0..hits``; load
    blocks ``0..k-1``, recompute the rest.

    ``k`` is the largest ``k`` in ``1..hits`` with ``(queued_bytes + k * block_bytes) /
    bytes_per_s <= sum(recompute_seconds[:k])`` (the load of blocks 0..k-1, behind the bytes
    already queued, ends no later than their recompute would), else 0; see the module docs
    for why. ``block_bytes``: one block's payload bytes (> 0); ``queued_bytes``: bytes of loads
    queued ahead (>= 0); ``bytes_per_s``: the tier's load bandwidth (> 0, ``math.inf``
    allowed); ``recompute_seconds``: block j's prefill seconds for j in 0..hits-1 (more are
    ignored; e.g. :meth:`PrefillModel.blocks_seconds`). ValueError for a figure out of range
    or fewer than ``hits`` recompute figures.
    """
    n = _count("hits", hits)
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
        raise ValueError(f"block_bytes must be a positive integer, got {block_bytes!r}")
    q = _number("queued_bytes", queued_bytes, positive=False)
    w = _number("bytes_per_s", bytes_per_s, positive=True, allow_inf=True)
    if len(recompute_seconds) < n:
        raise ValueError(f"recompute_seconds has {len(recompute_seconds)} figures for {n} hits")
    best = 0
    total = 0.0
    for k in range(1, n + 1):
        total += _number("recompute_seconds[j]", recompute_seconds[k - 1], positive=False)
        if (q + k * block_bytes) / w <= total:
            best = k
    return best
