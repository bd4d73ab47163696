"""pykvtier: the disk tier under an LLM inference engine's KV cache.

Blocks are stored to and loaded from a POSIX directory (NVMe) through a C++ io_uring engine,
with a two-phase API: :meth:`DiskTier.lookup` (never blocks) and batched jobs
(:meth:`DiskTier.submit_load` / :meth:`DiskTier.submit_store`). See docs/design.md.
"""

try:
    from . import _native  # noqa: F401  (the compiled data path)
except ImportError as _exc:
    import os as _os

    raise ImportError(
        f"pykvtier: {_os.path.dirname(__file__)} has no compiled modules ({_exc}); a source tree "
        "in the working directory shadows the installed package: run from another directory, "
        "or install the checkout with `pip install -e .`") from _exc

from .buffers import host_arena
from .tier import DiskTier, JobResult, LookupResult, TransferJob
from .promotion import Promoter, PromotionResult

__all__ = ["DiskTier", "JobResult", "LookupResult", "Promoter", "PromotionResult", "TransferJob",
           "host_arena"]
__version__ = "0.1.0"
