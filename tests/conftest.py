"""Fixtures every test directory may use.

``etcd``: a real etcd for the metadata-store tests (tests/store, tests/runtime), one server
per test, on loopback, with its own data directory, killed in teardown whatever the test
did."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvwire.testing.etcd import EtcdServer


@pytest.fixture
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    try:
        yield server.start()
    finally:
        server.close()
