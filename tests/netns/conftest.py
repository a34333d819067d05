"""Makes the ``netns_pair`` fixture (tests/netns/netns_fixtures.py) available here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netns_fixtures import netns_pair  # noqa: F401
