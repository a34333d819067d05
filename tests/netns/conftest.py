"""Makes the ``netns_pair`` fixture (tests/netns/netns_fixtures.py, importable through the
``pythonpath`` setting in pyproject.toml) available here."""

from __future__ import annotations

from netns_fixtures import netns_pair  # noqa: F401
