"""Build hook: compile the transports' optional C helpers into the wheel.

The core ``kvwire`` package stays pure Python; only the transports carry native helpers
(``kvwire_shm._native``, ``kvwire_ucx._native``), each a single C file built with the
compiler Python was built with (``sysconfig``'s ``CC``) against this interpreter's headers.
A helper that does not build (no compiler, no headers) is left out with one warning line,
and its transport runs its pure-Python path; ``KVWIRE_NO_NATIVE=1`` skips the build on
purpose. Editable installs (``pip install -e``, what ``make`` does) put the modules next to
their sources, which is where the editable install imports the packages from.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

HELPERS = {
    "kvwire_shm._native": "transports/shm/kvwire_shm/_native.c",
    "kvwire_ucx._native": "transports/ucx/kvwire_ucx/_native.c",
}
"""Module name -> C source, relative to the project root."""

CFLAGS = ["-O2", "-std=gnu11", "-fPIC", "-shared", "-Wall", "-fvisibility=hidden"]


def compile_helper(source: Path, target: Path) -> str | None:
    """Compile ``source`` into the extension module ``target``; None, or why not."""
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc[0]) is None:
        return f"no C compiler ({cc[0]})"
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").exists():
        return f"no Python headers in {include}"
    cmd = [*cc, *CFLAGS, f"-I{include}", str(source), "-o", str(target)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    except OSError as exc:
        return f"{cc[0]}: {exc}"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        return f"{' '.join(cmd)}: {last}"
    return None


class NativeHelpers(BuildHookInterface):  # type: ignore[type-arg]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        if os.environ.get("KVWIRE_NO_NATIVE", "") not in ("", "0"):
            sys.stderr.write("kvwire build: KVWIRE_NO_NATIVE set, native helpers not built\n")
            return
        root = Path(self.root)
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        editable = version == "editable"
        out = Path(tempfile.mkdtemp(prefix="kvwire-native-"))
        built = False
        for module, source in HELPERS.items():
            package, name = module.split(".")
            src = root / source
            target = (src.parent if editable else out / package) / f"{name}{suffix}"
            target.parent.mkdir(exist_ok=True)
            why = compile_helper(src, target)
            if why is not None:
                sys.stderr.write(f"kvwire build: {module} not built ({why}); pure Python path\n")
                continue
            built = True
            if not editable:
                build_data["force_include"][str(target)] = f"{package}/{target.name}"
        if built and not editable:
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
