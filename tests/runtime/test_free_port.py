"""``kvwire.testing.ports.free_port``: the ports tests hand to listeners started later."""

from __future__ import annotations

import pytest

from kvwire.testing import ports


@pytest.mark.parametrize(
    "spec", ["abc", "1000", "1-2-3", "2000-1000", "3000-3000", "80-90", "1024-70000", " - "]
)
def test_a_malformed_range_is_refused_by_name(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ports.PORTS_VAR, spec)
    with pytest.raises(ValueError, match=f"{ports.PORTS_VAR} must be LOW-HIGH.*{spec!r}"):
        ports.free_port()


def test_ports_come_from_the_range_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight ports at the top of this suite's own range: each handed out at most once, and
    the ninth call finds none left and says which range."""
    _, high = ports._range()
    top = f"{high - 8}-{high}"
    monkeypatch.setenv(ports.PORTS_VAR, top)
    given: list[int] = []
    with pytest.raises(RuntimeError, match=f"no free port in \\[{high - 8}, {high}\\)"):
        for _ in range(9):
            given.append(ports.free_port())
    assert len(given) == len(set(given)) <= 8
    assert all(high - 8 <= port < high for port in given)
