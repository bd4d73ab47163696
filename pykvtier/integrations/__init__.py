"""Adapters that plug pykvtier into inference engines.

Each adapter lives in its own module and imports its engine only there, so importing
``pykvtier`` or this package never imports an engine:

- :mod:`pykvtier.integrations.vllm`: ``PyKVTier``, an out-of-tree secondary tier of vLLM's
  tiered KV offloading (vLLM >= 0.32; 0.33.0 is the reference). Loaded by vLLM from config
  alone: ``{"type": "PyKVTier", "module_path": "pykvtier.integrations.vllm", "root_dir": ...}``.
  Needs ``pip install 'pykvtier[vllm]'``.
- :mod:`pykvtier.integrations.sglang`: ``PyKVTierHiCache``, a storage backend of SGLang's
  hierarchical cache (HiCache; 0.5.23 is the reference). Loaded by SGLang from its launch flags:
  ``--hicache-storage-backend dynamic --hicache-storage-backend-extra-config
  '{"backend_name": "pykvtier", "module_path": "pykvtier.integrations.sglang",
  "class_name": "PyKVTierHiCache", "interface_v1": 1, "root_dir": ...}'``. Needs
  ``pip install 'pykvtier[sglang]'``.
"""

__all__: list[str] = []
