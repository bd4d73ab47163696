"""Arenas: the memory blocks are loaded into and stored from (host memory, or a CUDA tensor).

An arena is one contiguous, writable region split into equal slots: slot ``c`` is bytes
``[c * slot_bytes, (c + 1) * slot_bytes)``. Accepted objects: numpy arrays, anything with the
buffer protocol (memoryview, bytearray, mmap), CPU torch tensors (pinned or not), and CUDA torch
tensors (a device arena: see :mod:`pykvtier.gpu`). The C++
engine reads and writes the memory directly by address; no Python copy is made. The object is
kept alive by the :class:`Arena` for as long as the tier uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Arena", "as_arena", "host_arena"]


@dataclass(frozen=True)
class Arena:
    """A memory region: ``addr`` (int), ``nbytes``, ``slot_bytes`` (stride between slots),
    ``device`` ("cpu", or the CUDA device of a device arena, e.g. "cuda:0"). ``span``: slots a
    block covers; 1 (slots apart) unless the arena is spanning (``DiskTier.set_arena(...,
    spanning=True)``: a block may start at any slot and covers ``span`` consecutive ones)."""

    addr: int
    nbytes: int
    slot_bytes: int
    readonly: bool
    owner: Any  # keeps the memory alive
    device: str = "cpu"
    span: int = 1

    @property
    def num_slots(self) -> int:
        """Slots a block can start at: every one whose block ends inside the arena."""
        return max(0, self.nbytes // self.slot_bytes - self.span + 1)

    def slot_addr(self, slot: int) -> int:
        return self.addr + slot * self.slot_bytes

    def release(self) -> None:
        """Drops the buffer export that locks the memory (call once no I/O can touch it)."""
        if isinstance(self.owner, tuple) and isinstance(self.owner[-1], memoryview):
            self.owner[-1].release()


def host_arena(num_slots: int, slot_bytes: int) -> "np.ndarray":
    """A page-aligned, zero-filled host arena: a uint8 array of shape (num_slots, slot_bytes)
    backed by an anonymous mapping (``numpy.empty`` gives no page alignment). For pinned memory
    that a GPU can copy from, use a pinned torch tensor instead."""
    import mmap

    import numpy as np

    for name, v in (("num_slots", num_slots), ("slot_bytes", slot_bytes)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if num_slots <= 0 or slot_bytes <= 0:
        raise ValueError(f"num_slots and slot_bytes must be positive, got {num_slots}, {slot_bytes}")
    m = mmap.mmap(-1, num_slots * slot_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(m, dtype=np.uint8).reshape(num_slots, slot_bytes)


def _torch_region(obj: Any) -> tuple[int, int, bool] | None:
    mod = type(obj).__module__
    if not mod.startswith("torch"):
        return None
    if obj.device.type not in ("cpu", "cuda"):
        raise ValueError(f"arena is a {obj.device.type} tensor; pykvtier takes CPU or CUDA memory")
    if not obj.is_contiguous():
        raise ValueError("arena tensor is not contiguous")
    return int(obj.data_ptr()), int(obj.numel() * obj.element_size()), False


def _buffer_region(obj: Any) -> tuple[int, int, bool, memoryview]:
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
    return int(arr.ctypes.data), mv.nbytes, bool(mv.readonly), mv


def _row_bytes(obj: Any, is_torch: bool) -> int | None:
    """Bytes between rows of a multi-dimensional array / memoryview / tensor, else None."""
    if is_torch:
        if hasattr(obj, "stride") and callable(obj.stride) and obj.dim() >= 2:
            return int(obj.stride(0)) * int(obj.element_size())
        return None
    strides = getattr(obj, "strides", None)
    if not strides or len(strides) < 2:
        return None
    return int(strides[0])


def as_arena(obj: Any, slot_bytes: int | None = None, *,
             default_slot_bytes: int | None = None) -> Arena:
    """Wraps ``obj`` as an :class:`Arena`.

    A multi-dimensional array/memoryview/tensor has one slot per row: ``slot_bytes`` defaults to
    its row (``strides[0]``; vLLM's primary KV view is ``(num_chunks, stride)``), and a
    ``slot_bytes`` longer than a row is an error. A 1-dimensional one takes ``slot_bytes``, else
    ``default_slot_bytes``. An :class:`Arena` is taken as it is. Raises TypeError for an
    unsupported object, ValueError for non-contiguous memory, a device other than CPU/CUDA, a
    1-dimensional arena without a slot size, a row shorter than ``slot_bytes``, or a size
    smaller than one slot.
    """
    if isinstance(obj, Arena):
        return obj
    region = _torch_region(obj)
    if region is not None:
        addr, nbytes, readonly = region
        owner: Any = obj
    else:
        # Keep the memoryview export: it locks the buffer, so a bytearray cannot be resized
        # nor an mmap closed under the engine (BufferError instead of a use after free).
        addr, nbytes, readonly, export = _buffer_region(obj)
        owner = (obj, export)
    device = str(obj.device) if region is not None else "cpu"
    row = _row_bytes(obj, region is not None)
    if slot_bytes is None:
        slot_bytes = row if row is not None else default_slot_bytes
        if slot_bytes is None:
            raise ValueError("slot_bytes is needed for a 1-dimensional arena")
    elif row is not None and slot_bytes > row:
        raise ValueError(f"arena rows of {row} bytes are shorter than slot_bytes={slot_bytes}: "
                         "a multi-dimensional arena has one slot per row")
    if slot_bytes <= 0:
        raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
    if nbytes < slot_bytes:
        raise ValueError(f"arena of {nbytes} bytes is smaller than one slot of {slot_bytes} bytes")
    return Arena(addr=addr, nbytes=nbytes, slot_bytes=int(slot_bytes), readonly=readonly, owner=owner,
                 device=device)
