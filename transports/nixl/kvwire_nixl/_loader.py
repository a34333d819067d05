"""Finding the NIXL Python binding, only when a transport is created.

``import kvwire_nixl`` must stay cheap and must work where NIXL is absent, so the binding
is imported here, on first use. The CUDA-12 wheel (``nixl-cu12``, module ``nixl_cu12``)
is what the ``nixl`` extra installs; the CUDA-13 wheel and the ``nixl`` meta package
(slow to import, pulls both variants) are accepted as fallbacks so a GPU host that has
only those still works.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

from kvwire.errors import TransportUnavailableError

CANDIDATES = ("nixl_cu12", "nixl_cu13", "nixl")
INSTALL_HINT = "pip install 'kvwire[nixl]'"

_cached: tuple[ModuleType, ModuleType] | None = None


def load_nixl() -> tuple[ModuleType, ModuleType]:
    """``(api, bindings)``: the module with ``nixl_agent`` and its compiled ``_bindings``."""
    global _cached
    if _cached is not None:
        return _cached
    skip_unusable_ib_modules()
    errors: list[str] = []
    for name in CANDIDATES:
        try:
            api = importlib.import_module(name)
            bindings = importlib.import_module(f"{name}._bindings")
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if not hasattr(api, "nixl_agent"):
            errors.append(f"{name}: has no nixl_agent")
            continue
        _quiet_python_logging()
        _cached = (api, bindings)
        return _cached
    raise TransportUnavailableError(
        f"the nixl transport needs NIXL's Python binding, which cannot be imported "
        f"({'; '.join(errors)}); install it with: {INSTALL_HINT}"
    )


RDMA_DEVICES = "/sys/class/infiniband"


def skip_unusable_ib_modules(devices: str = RDMA_DEVICES) -> bool:
    """On a host with no RDMA device, keep UCX from loading its InfiniBand modules
    (``UCX_MODULES=^ib*``, unless the user set ``UCX_MODULES``); True when it did.

    They have nothing to drive there, and they are harmful where the system's rdma-core is
    installed beside the copy bundled in the wheel: the bundled ``libibverbs`` loads the
    system's providers, which bring the system's ``libnl`` beside the bundled one, and the
    two crash the process in ``rtnl_tc_unregister`` when it exits (seen here: every NIXL
    process exited with SIGSEGV after ``libibverbs1`` was installed by apt). UCX reads the
    setting when NIXL's UCX plugin loads, so it must be in place before the first agent.
    """
    if "UCX_MODULES" in os.environ or os.path.isdir(devices):
        return False
    os.environ["UCX_MODULES"] = "^ib*"
    return True


def _quiet_python_logging() -> None:
    """NIXL logs every agent creation at INFO to *stdout*, which would corrupt the JSON a
    ``--json`` command prints; keep its Python logger at WARNING unless the user asked
    for a level through NIXL's own ``NIXL_LOG_LEVEL``."""
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
