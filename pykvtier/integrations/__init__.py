"""Adapters that plug pykvtier into inference engines.

Each adapter lives in its own module and imports its engine only there, so importing
``pykvtier`` or this package never imports an engine:

- :mod:`pykvtier.integrations.vllm`: ``PyKVTier``, an out-of-tree secondary tier of vLLM's
  tiered KV offloading (vLLM >= 0.32; 0.33.0 is the reference). Loaded by vLLM from config
  alone: ``{"type": "PyKVTier", "module_path": "pykvtier.integrations.vllm", "root_dir": ...}``.
  Needs ``pip install 'pykvtier[vllm]'``.
"""

__all__: list[str] = []
