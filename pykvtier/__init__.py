"""pykvtier: the disk tier under an LLM inference engine's KV cache.

Blocks are stored to and loaded from a POSIX directory (NVMe) through a C++ io_uring engine,
with a two-phase API: :meth:`DiskTier.lookup` (never blocks) and batched jobs
(:meth:`DiskTier.submit_load` / :meth:`DiskTier.submit_store`). See DESIGN.md.
"""

from .buffers import host_arena
from .tier import DiskTier, JobResult, LookupResult, TransferJob
from .promotion import Promoter, PromotionResult

__all__ = ["DiskTier", "JobResult", "LookupResult", "Promoter", "PromotionResult", "TransferJob",
           "host_arena"]
__version__ = "0.1.0"
