"""``kvwire.testing.ports.free_port``: the ports tests hand to listeners started later."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.testing import ports

SPECS = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12),
    st.tuples(st.integers(-10, 70000), st.integers(-10, 70000)).map(lambda t: f"{t[0]}-{t[1]}"),
)
"""Anything an environment can hold, and ranges in and around the valid ones."""


@settings(max_examples=300, deadline=None)
@given(SPECS)
def test_any_range_is_used_or_refused_by_name(spec: str) -> None:
    """A range is used (a port inside it, or none left there) or refused with a
    ``ValueError`` that names the variable and the value; never another error."""
    saved = os.environ.get(ports.PORTS_VAR)
    os.environ[ports.PORTS_VAR] = spec
    try:
        port = ports.free_port()
    except ValueError as exc:
        assert ports.PORTS_VAR in str(exc) and repr(spec) in str(exc)
        return
    except RuntimeError as exc:  # a valid range whose ports are all taken or given
        assert "no free port" in str(exc)
        return
    finally:
        if saved is None:
            del os.environ[ports.PORTS_VAR]
        else:
            os.environ[ports.PORTS_VAR] = saved
    if spec:
        low, high = (int(part) for part in spec.split("-"))
        assert 1024 <= low <= port < high <= 65536


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
