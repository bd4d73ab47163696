"""A CPU stand-in for LMCache's GPU connector, for driving LMCache's own engine on a machine
without a GPU (tests/test_lmcache*.py, bench/vs_lmcache_disk.py).

LMCache's ``MockGPUConnector`` moves no bytes, so a round trip through it proves nothing; this
one copies between a CPU "paged" KV tensor of shape ``[num_layers, 2, num_tokens, heads *
head_dim]`` (passed to ``LMCacheEngine.store`` / ``retrieve`` as ``kvcaches=``) and LMCache's
memory objects of shape ``[2, num_layers, tokens, heads * head_dim]`` (format KV_2LTD, as
``LMCacheMetadata.get_shapes`` gives them). LMCache is imported when the class is built.
"""

from __future__ import annotations

from typing import Any


def cpu_connector(num_layers: int, hidden: int) -> Any:
    """A ``GPUConnectorInterface`` instance for a KV tensor ``[num_layers, 2, T, hidden]``."""
    import torch
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

    class CPUConnector(GPUConnectorInterface):
        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, start:end].permute(1, 0, 2, 3))

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            kwargs["kvcaches"][:, :, start:end].copy_(memory_obj.tensor.permute(1, 0, 2, 3))

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends):
                self.from_gpu(m, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs: Any = None, starts: Any = None, ends: Any = None,
                           **kwargs: Any) -> None:
            for m, s, e in zip(memory_objs, starts, ends):
                self.to_gpu(m, s, e, **kwargs)

        def get_shape(self, num_tokens: int) -> Any:
            return torch.Size([2, num_layers, num_tokens, hidden])

    return CPUConnector()
