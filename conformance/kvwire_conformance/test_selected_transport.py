"""The suite against the transport named on the command line (what ``kvwire conformance``
runs): ``pytest --pyargs kvwire_conformance.test_selected_transport --kvwire-transport NAME``.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvwire_conformance.plugin import parse_options
from kvwire_conformance.suite import TransportSuite


class TestSelectedTransport(TransportSuite):
    @classmethod
    def transport_spec(cls, config: pytest.Config) -> tuple[str, dict[str, Any]]:
        name = config.getoption("--kvwire-transport") or ""
        return str(name), parse_options(config.getoption("--kvwire-option"))
