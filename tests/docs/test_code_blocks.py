"""Every ```python block of the README and of docs/ runs, so the code an adopter copies
cannot rot.

A page's blocks run in order as one program, in a fresh interpreter. A few pages show
calls on objects an earlier step made (a consumer with finished requests, a peer agent's
metadata); their prelude below makes those objects with real parts, and the page's own
blocks then run unchanged. The README's example gets no prelude: it is a whole program.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)

_README = "\n".join(BLOCK.findall((ROOT / "README.md").read_text()))


def _peer_agent(transport: str, peer: str) -> str:
    """A second agent in the same process with 64 KiB registered, and descriptors of its
    first 4 KiB and ours, under the names the transport pages use."""
    return f"""
import numpy as np
from kvwire.transport import create as _create, region_of_array as _region
kv = np.zeros(1 << 16, dtype=np.uint8)
_peer_kv = (np.arange(1 << 16) % 251).astype(np.uint8)
_peer = _create({transport!r}, {peer!r})
_peer.register([_region(_peer_kv)])
blob_from_peer = peer_blob = _peer.local_metadata()
local_descs = np.array([[kv.ctypes.data, 4096, 0]], dtype=np.int64)
remote_descs = np.array([[_peer_kv.ctypes.data, 4096, 0]], dtype=np.int64)
"""


PRELUDES: dict[str, str] = {
    "docs/operations.md": _README,  # a consumer that received req-1
    "docs/transports.md": _peer_agent("nixl", "decode-0"),
    "docs/transport-ucx.md": _peer_agent("ucx", "prefill-0"),
}
_SAME_BYTES = "assert (kv[:4096] == _peer_kv[:4096]).all()\nagent.close()\n_peer.close()"
CHECKS: dict[str, str] = {"docs/transports.md": _SAME_BYTES, "docs/transport-ucx.md": _SAME_BYTES}


def pages() -> list[str]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [str(p.relative_to(ROOT)) for p in found if BLOCK.search(p.read_text())]


def test_the_pages_with_code_are_found() -> None:
    assert {"README.md", "docs/engine-integration.md", "docs/configuration.md"} <= set(pages())
    assert set(PRELUDES) <= set(pages())


@pytest.mark.parametrize("page", pages())
def test_the_page_s_python_blocks_run(page: str, tmp_path: Path) -> None:
    blocks = BLOCK.findall((ROOT / page).read_text())
    for block in blocks:
        assert not re.search(r"^\s*\.\.\.\s*$", block, re.MULTILINE), (
            f"{page}: a block hides code behind a bare '...'"
        )
    program = "\n".join([PRELUDES.get(page, ""), *blocks, CHECKS.get(page, "")])
    script = tmp_path / "page.py"
    script.write_text(program)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}
    env["UCX_NET_DEVICES"] = "lo"
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"{page} failed:\n{proc.stderr[-3000:]}"


def test_the_readme_example_follows_kvwire_variables(tmp_path: Path) -> None:
    """KVWIRE_HANDSHAKE_TIMEOUT_S=1 KVWIRE_HANDSHAKE_RETRIES=0 change what the README's
    code does: its runtimes' handshake policy (and so how long D waits for a silent P)."""
    report = (
        "\nprint('policy', consumer.config.handshake_timeout_s, "
        "consumer.config.handshake_retries, consumer.config.handshake_budget_s())\n"
    )
    script = tmp_path / "readme.py"
    script.write_text(_README + report)
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}
    runs = {}
    for name, extra in (
        ("default", {}),
        ("set", {"KVWIRE_HANDSHAKE_TIMEOUT_S": "1", "KVWIRE_HANDSHAKE_RETRIES": "0"}),
    ):
        proc = subprocess.run(
            [sys.executable, str(script)],
            env={**base, **extra},
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = proc.stdout.splitlines()[-1]
    assert runs["default"] == "policy 5.0 2 16.3"
    assert runs["set"] == "policy 1.0 0 2.0"
