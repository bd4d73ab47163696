"""The ``posix`` engine: plain ``preadv``/``pwritev`` on a small pool of C++ threads.

For machines where io_uring is refused (some containers' seccomp profiles block
``io_uring_setup``; ``kernel.io_uring_disabled``; old kernels). :class:`PosixEngine` is
``pykvtier._native.PosixEngine``: the same interface, entry tuples, results, counters and block
format as ``pykvtier._native.Engine``, so :class:`~pykvtier.tier.DiskTier` uses either. Its
threads never take the GIL: a request costs its system calls (open, fstat, one ``preadv`` or
``pwritev`` of header and payload, ``renameat2``, close) and its XXH3, nothing of the
interpreter.
"""

from __future__ import annotations

from ._native import PosixEngine

__all__ = ["PosixEngine"]
