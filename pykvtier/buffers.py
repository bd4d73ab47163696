"""Host arenas: the memory blocks are loaded into and stored from.

An arena is one contiguous, writable region split into equal slots: slot ``c`` is bytes
``[c * slot_bytes, (c + 1) * slot_bytes)``. Accepted objects: numpy arrays, anything with the
buffer protocol (memoryview, bytearray, mmap), and CPU torch tensors (pinned or not). The C++
engine reads and writes the memory directly by address; no Python copy is made. The object is
kept alive by the :class:`Arena` for as long as the tier uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Arena", "as_arena"]


@dataclass(frozen=True)
class Arena:
    """A host memory region: ``addr`` (int), ``nbytes``, ``slot_bytes`` (stride between slots)."""

    addr: int
    nbytes: int
    slot_bytes: int
    readonly: bool
    owner: Any  # keeps the memory alive

    @property
    def num_slots(self) -> int:
        return self.nbytes // self.slot_bytes

    def slot_addr(self, slot: int) -> int:
        return self.addr + slot * self.slot_bytes


def _torch_region(obj: Any) -> tuple[int, int, bool] | None:
    mod = type(obj).__module__
    if not mod.startswith("torch"):
        return None
    if obj.device.type != "cpu":
        raise ValueError(
            f"arena is a {obj.device.type} tensor; the host path needs CPU memory "
            "(GPU destinations need the gds engine)"
        )
    if not obj.is_contiguous():
        raise ValueError("arena tensor is not contiguous")
    return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), False


def _buffer_region(obj: Any) -> tuple[int, int, bool]:
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"arena must be a numpy array, a CPU torch tensor or a buffer-protocol object, "
            f"not {type(obj).__name__}"
        ) from None
    if not mv.c_contiguous:
        raise ValueError("arena memory is not C-contiguous")
    import numpy as np

    arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
    return int(arr.ctypes.data), mv.nbytes, bool(mv.readonly)


def as_arena(obj: Any, slot_bytes: int | None = None) -> Arena:
    """Wraps ``obj`` as an :class:`Arena`.

    ``slot_bytes`` defaults to ``strides[0]`` of a multi-dimensional array/memoryview (vLLM's
    primary KV view is ``(num_chunks, stride)``), else must be given. Raises TypeError for an
    unsupported object, ValueError for non-contiguous or device memory or a size that is not a
    whole number of slots.
    """
    region = _torch_region(obj)
    addr, nbytes, readonly = region if region is not None else _buffer_region(obj)
    if slot_bytes is None:
        if region is not None and hasattr(obj, "stride") and callable(obj.stride) and obj.dim() >= 2:
            slot_bytes = int(obj.stride(0)) * int(obj.element_size())
        else:
            strides = getattr(obj, "strides", None)
            if not strides or len(strides) < 2:
                raise ValueError("slot_bytes is needed for a 1-dimensional arena")
            slot_bytes = int(strides[0])
    if slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
    if nbytes < slot_bytes:
        raise ValueError(f"arena of {nbytes} bytes is smaller than one slot of {slot_bytes} bytes")
    return Arena(addr=addr, nbytes=nbytes, slot_bytes=int(slot_bytes), readonly=readonly, owner=obj)
