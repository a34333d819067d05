"""The fixture's own promises: it cleans up after a failing test, and it says why it skips."""

from __future__ import annotations

import subprocess
import time

import pytest
from netns_fixtures import emit, netns_pair_context, unavailable_reason


def sleep_forever() -> None:
    emit("running")
    while True:
        time.sleep(1)


def test_netns_pair_is_deleted_even_when_the_test_fails() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    names: list[str] = []
    with pytest.raises(RuntimeError, match="the test failed"), netns_pair_context() as pair:
        names += [pair.a.name, pair.b.name]
        child = pair.a.start(sleep_forever)
        assert child.message(timeout=60) == "running"
        raise RuntimeError("the test failed")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names), listed
    assert child.proc.wait(timeout=30) != 0, "the process left inside was not ended"
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert pair.a.device not in links and pair.b.device not in links


def test_netns_skip_reason_names_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda _: None)
    assert "iproute2" in (unavailable_reason() or "")
    monkeypatch.setattr("shutil.which", lambda _: "/usr/sbin/ip")
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert "root" in (unavailable_reason() or "")
