"""``pip install kvwire[nixl,ucx]`` from the built distributions works in a fresh venv.

The sdist is built from the working tree and the wheel from the sdist (``python -m build``
does both), so a file missing from the sdist breaks the wheel. The wheel goes into a new,
empty virtual environment — no system site-packages, nothing of this checkout on the path —
with the project's constraints, so NIXL's unpinned ``torch`` resolves to the pinned CPU
wheel. Then, run from outside the checkout: the CLI, every import package, the entry
points, and one shm transfer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "kvwire": "kvwire",
    "kvwire_shm": "transports/shm/kvwire_shm",
    "kvwire_nixl": "transports/nixl/kvwire_nixl",
    "kvwire_ucx": "transports/ucx/kvwire_ucx",
    "kvwire_conformance": "conformance/kvwire_conformance",
}

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    # Not tmp_path: pytest keeps old temp dirs, and this one holds a ~1 GB venv (torch).
    path = Path(tempfile.mkdtemp(prefix="kvwire-wheel-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def dists(workdir: Path) -> dict[str, Path]:
    out = workdir / "dist"
    # No isolation: hatchling comes from the dev environment, so no index is needed here.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)], ROOT)
    (sdist,) = out.glob("kvwire-*.tar.gz")
    (wheel,) = out.glob("kvwire-*.whl")
    return {"sdist": sdist, "wheel": wheel}


@pytest.fixture(scope="module")
def venv_python(workdir: Path, dists: dict[str, Path]) -> Path:
    venv = workdir / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], workdir)
    python = venv / "bin" / "python"
    requirement = f"kvwire[nixl,ucx] @ {dists['wheel'].as_uri()}"
    constraints = str(ROOT / "constraints-dev.txt")
    # --no-compile: byte-compiling torch's thousands of modules would triple the time.
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
    _run([*pip, "--no-compile", "-c", constraints, requirement], workdir, timeout=600)
    return python


def test_sdist_holds_every_package_and_its_py_typed(dists: dict[str, Path]) -> None:
    with tarfile.open(dists["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for source in PACKAGES.values():
        assert f"{source}/__init__.py" in names
        assert f"{source}/py.typed" in names
    assert "pyproject.toml" in names and "README.md" in names


def test_wheel_holds_every_import_package_typed(dists: dict[str, Path]) -> None:
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        names = set(wheel.namelist())
    for package in PACKAGES:
        assert f"{package}/__init__.py" in names
        assert f"{package}/py.typed" in names
    assert not any(n.startswith(("tests/", "transports/", "conformance/")) for n in names)
    if os.environ.get("KVWIRE_NO_NATIVE", "") in ("", "0"):  # built by hatch_build.py
        for package in ("kvwire_shm", "kvwire_ucx"):
            assert any(n.startswith(f"{package}/_native.") and n.endswith(".so") for n in names)


def test_the_cli_runs(venv_python: Path, workdir: Path) -> None:
    out = _run([str(venv_python.parent / "kvwire"), "--help"], workdir).stdout
    for command in ("demo", "bench", "sim", "probe", "decode", "compat-hash", "conformance"):
        assert command in out


def test_every_package_imports_from_the_venv(venv_python: Path, workdir: Path) -> None:
    script = (
        "import sys, kvwire, kvwire_shm, kvwire_nixl, kvwire_ucx, kvwire_conformance\n"
        "for m in (kvwire, kvwire_shm, kvwire_nixl, kvwire_ucx, kvwire_conformance):\n"
        "    assert m.__file__.startswith(sys.prefix), m.__file__\n"
        "from kvwire_shm._native_load import NATIVE as shm\n"
        "from kvwire_ucx._native_load import NATIVE as ucx\n"
        "import os; off = os.environ.get('KVWIRE_NO_NATIVE', '') not in ('', '0')\n"
        "assert (shm is None and ucx is None) if off else (shm and ucx), (shm, ucx)\n"
        "heavy = {'torch', 'nixl_cu12', 'pytest'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "print(kvwire.__version__)\n"
    )
    assert _run([str(venv_python), "-c", script], workdir).stdout.strip() == "0.1.0"


def test_entry_points_are_found(venv_python: Path, workdir: Path) -> None:
    script = (
        "from importlib.metadata import entry_points\n"
        "from kvwire.transport import available, load\n"
        "print(sorted(available()))\n"
        "for name in available(): load(name)\n"
        "plugins = entry_points(group='pytest11')\n"
        "print([ep.value for ep in plugins if ep.name == 'kvwire_conformance'])\n"
    )
    lines = _run([str(venv_python), "-c", script], workdir).stdout.splitlines()
    assert lines == ["['nixl', 'shm', 'ucx']", "['kvwire_conformance.plugin']"]


def test_a_shm_transfer_moves_bytes(venv_python: Path, workdir: Path) -> None:
    script = (
        "import numpy as np\n"
        "from kvwire.transport import XferState, as_descs, create, region_of_array, wait_for\n"
        "p, d = create('shm', 'prefill'), create('shm', 'decode')\n"
        "src = np.arange(4096, dtype=np.uint8); dst = np.zeros(4096, dtype=np.uint8)\n"
        "p.register([region_of_array(src)]); d.register([region_of_array(dst)])\n"
        "peer = d.add_peer(p.local_metadata())\n"
        "local = as_descs([[dst.ctypes.data, 4096, 0]])\n"
        "remote = as_descs([[src.ctypes.data, 4096, 0]])\n"
        "handle = d.read(peer, local, remote, b'req-1:1')\n"
        "assert wait_for(d, handle, 30.0) is XferState.DONE\n"
        "d.release(handle)\n"
        "assert (dst == src).all()\n"
        "got = []\n"
        "for _ in range(3000):\n"
        "    got += p.drain_notifications()\n"
        "    if got: break\n"
        "    p.wait(0.01)\n"
        "print([m for _, m in got])\n"
        "p.close(); d.close()\n"
    )
    assert _run([str(venv_python), "-c", script], workdir).stdout.strip() == "[b'req-1:1']"
