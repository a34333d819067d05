"""The whole library of broken variants: the shm variants and wrappers
(:mod:`kvwire_broken_shm`), and the NIXL and UCX adapters' own (:mod:`kvwire_broken_nixl`,
:mod:`kvwire_broken_ucx`). A variant for a new transport goes in a module of its own,
``kvwire_broken_<transport>.py`` beside these, joined here.
"""

from __future__ import annotations

import importlib

from kvwire_broken_shm import VARIANTS as SHM
from kvwire_broken_shm import Variant

MODULES = ("kvwire_broken_nixl", "kvwire_broken_ucx")
"""Libraries whose adapters may be missing (an extra not installed): joined if present."""


def _load() -> dict[str, Variant]:
    out = dict(SHM)
    for module in MODULES:
        try:
            variants: dict[str, Variant] = importlib.import_module(module).VARIANTS
        except ImportError:
            continue
        out.update(variants)
    return out


VARIANTS = _load()
