"""``import kvwire`` must stay light: no torch, NIXL, UCX or pytest in the core."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("torch", "nixl", "nixl_cu12", "libucx", "ucp", "ucxx", "pytest", "_pytest")

PROBE = """
import json, sys
import kvwire, kvwire.wire, kvwire.wire.compat, kvwire.cli
kvwire.decode_notification(b"HB:a")
print(json.dumps(sorted(sys.modules)))
"""


def test_import_kvwire_loads_no_heavy_or_test_modules() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(result.stdout)
    assert "kvwire.wire" in loaded and "msgspec" in loaded  # the probe saw real imports
    offenders = [
        name for name in loaded if name.split(".")[0] in FORBIDDEN or "ucx" in name.split(".")[0]
    ]
    assert offenders == []
