"""``kvwire.peer`` is core machinery: light to import, and reached only on purpose."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import kvwire, kvwire.cli
before = sorted(sys.modules)
import kvwire.peer, kvwire.peer.process
print(json.dumps([before, sorted(sys.modules)]))
"""


def test_peer_package_is_not_loaded_by_kvwire_and_needs_no_test_tools() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    before, after = json.loads(result.stdout)
    assert "kvwire.cli" in before and "kvwire.peer.process" in after  # the probe really ran
    assert [name for name in before if name.startswith("kvwire.peer")] == []
    roots = {name.split(".")[0] for name in after}
    assert roots.isdisjoint({"pytest", "_pytest", "hypothesis", "kvwire_conformance", "torch"})
