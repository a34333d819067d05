"""Ctrl-C and SIGTERM end every long command with one line and leave no process behind.

Each command runs as a terminal would start it (its own process group); once it has
started its children, "Ctrl-C" is SIGINT to that whole group, as a terminal sends it, and
SIGTERM goes to the command alone, as ``kill`` sends it. Afterwards stderr has gained
exactly one line, no traceback, and every process the command started is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RUNS = {
    "demo": ["demo", "--requests", "1000000", "--tokens", "64", "--no-progress"],
    "soak": ["soak", "--seconds", "600", "--p-tp", "1", "--d-tp", "1", "--report-every", "600"],
    "bench": ["bench", "transport", "--transport", "shm", "--quick"],
    "conformance": ["conformance", "shm"],
}
CHILDREN = {"demo": 2, "soak": 2, "bench": 1, "conformance": 2}
"""Descendants each command has once it is really running."""


def _descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("command", "how"),
    [
        ("demo", signal.SIGINT),
        ("demo", signal.SIGTERM),
        ("soak", signal.SIGINT),
        ("bench", signal.SIGINT),
        ("conformance", signal.SIGINT),
        ("conformance", signal.SIGTERM),
    ],
)
def test_a_signal_ends_the_command_with_one_line(
    command: str, how: signal.Signals, tmp_path: Path
) -> None:
    err_path = tmp_path / "stderr"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}
    with err_path.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvwire", *RUNS[command]],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            process_group=0,
            # A terminal's foreground job has SIGINT at its default; a test run started in
            # the background (``make test &``) hands its children SIGINT ignored, and a
            # Python started that way never raises KeyboardInterrupt. Restore what a
            # terminal gives.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 120
        children: set[int] = set()
        while time.monotonic() < deadline and proc.poll() is None:
            children |= _descendants(proc.pid)
            if len({c for c in children if _alive(c)}) >= CHILDREN[command]:
                break
            time.sleep(0.2)
        assert proc.poll() is None, f"{command} ended early:\n{err_path.read_text()}"
        assert len(children) >= CHILDREN[command], "the command never started its children"
        time.sleep(1.0)  # let it get busy
        children |= _descendants(proc.pid)
        before = err_path.read_text()
        if how == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        else:
            proc.send_signal(signal.SIGTERM)  # what kill(1) does
        code = proc.wait(90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err_path.read_text()
    added = text[len(before) :].splitlines()
    word = "interrupted" if how == signal.SIGINT else "terminated"
    # The signal adds exactly one line, the last. A progress notice the command was
    # printing as the signal arrived (e.g. the bench's "baseline skipped") may precede it.
    assert added[-1:] == [f"kvwire {command}: {word}"], text
    assert all(line.startswith(f"kvwire {command}: ") for line in added), text
    assert sum(line.endswith((": interrupted", ": terminated")) for line in added) == 1, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert code == (130 if how == signal.SIGINT else 143)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(c) for c in children):
        time.sleep(0.1)
    assert not [c for c in children if _alive(c)], "processes left behind"
