"""A placeholder ``torchvision`` for tests that import SGLang on CPU-only torch.

PyPI's torchvision wheels for Linux are CUDA builds: on CPU torch they fail at import
("operator torchvision::nms does not exist"). SGLang's config package imports
``torchvision.transforms`` through two multimodal model configs (and transformers' video
processing through them), though nothing in ``sglang.srt.mem_cache`` or the cache controllers
uses it. :func:`install` keeps a torchvision that imports; only where none does, it puts
placeholder modules in ``sys.modules`` whose transforms raise when called. Tests only: a
process with the placeholder must not build image processors.
"""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types

_MODULES = (("torchvision", True), ("torchvision.transforms", True),
            ("torchvision.transforms.functional", False), ("torchvision.transforms.v2", True),
            ("torchvision.transforms.v2.functional", False))


class InterpolationMode(enum.Enum):
    """torchvision's enum of the same name (transformers reads its members at import)."""

    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _module(name: str, package: bool) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        m.__path__ = []
    m.__version__ = "0.0.0+placeholder"
    m.InterpolationMode = InterpolationMode

    def __getattr__(attr: str) -> object:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*args: object, **kwargs: object) -> None:
            raise RuntimeError(f"{name}.{attr}: torchvision is a test placeholder here "
                               "(tests/sglang_torchvision_stub.py)")
        return unavailable

    m.__getattr__ = __getattr__
    return m


def install() -> bool:
    """Installs the placeholder unless a real torchvision imports; True if installed."""
    if isinstance(sys.modules.get("torchvision"), types.ModuleType) and \
            getattr(sys.modules["torchvision"], "__version__", "").endswith("+placeholder"):
        return True
    try:
        import torchvision  # noqa: F401

        return False
    except Exception:
        for n in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[n]
    for name, package in _MODULES:
        sys.modules[name] = _module(name, package)
    for name, _ in _MODULES[1:]:
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, sys.modules[name])
    return True
