"""``kvwire fleet`` against a real etcd holding engines of two compatibility groups."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest
from kvwire_shm import allocate

from kvwire.cli import main as cli_main
from kvwire.config import KVWireConfig
from kvwire.demo.models import CacheSpec, preset
from kvwire.runtime import Producer
from kvwire.testing.etcd import EtcdServer


class Engines:
    def __init__(self, url: str) -> None:
        self.url = url
        self.made: list[Producer] = []
        self.memory: list[npt.NDArray[np.uint8]] = []

    def publish(self, engine_id: str, model: str) -> Producer:
        spec = CacheSpec(preset(model), 2, 8, 0, 1)
        producer = Producer(
            KVWireConfig(engine_id=engine_id, compat=spec.compat("pull"), metadata_store=self.url),
            "shm",
        )
        self.made.append(producer)
        buffer = allocate(spec.total_bytes)
        self.memory.append(buffer)
        producer.register_kv_caches(spec.geometry(int(buffer.ctypes.data)))
        assert producer.publisher is not None
        assert producer.publisher.published.wait(30.0)
        return producer


@pytest.fixture
def engines(etcd: EtcdServer) -> Iterator[Engines]:
    made = Engines(etcd.url)
    try:
        yield made
    finally:
        for producer in made.made:
            producer.close()


def test_fleet_lists_engines_by_group_and_names_the_differing_factors(
    engines: Engines, capsys: pytest.CaptureFixture[str]
) -> None:
    engines.publish("p-8b-1", "llama-3-8b")
    engines.publish("p-8b-2", "llama-3-8b")
    engines.publish("p-70b", "llama-3-70b")
    assert cli_main(["fleet", "--store", engines.url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [g["engines"] for g in report["groups"]] in (
        [["p-8b-1", "p-8b-2"], ["p-70b"]],
        [["p-70b"], ["p-8b-1", "p-8b-2"]],
    )
    (pair,) = report["incompatible"]
    assert {"model", "num_hidden_layers"} <= set(pair["differing"])
    first = report["engines"][0]
    assert first["role"] == "producer" and first["tp_size"] == 1 and first["protocol_version"] == 13

    assert cli_main(["fleet", "--store", engines.url]) == 0
    text = capsys.readouterr().out
    assert "3 engines in 2 compatibility groups" in text and "cannot talk: model" in text


def test_fleet_watch_prints_again_when_an_engine_comes(
    engines: Engines, capsys: pytest.CaptureFixture[str]
) -> None:
    engines.publish("p-first", "llama-3-8b")
    codes: list[int] = []
    watcher = threading.Thread(
        target=lambda: codes.append(
            cli_main(["fleet", "--store", engines.url, "--json", "--watch", "--updates", "2"])
        )
    )
    watcher.start()
    out = ""
    try:
        deadline = time.monotonic() + 30.0
        while "\n" not in out and time.monotonic() < deadline:  # the first snapshot is out
            out += capsys.readouterr().out
            time.sleep(0.01)
        engines.publish("p-second", "llama-3-8b")
    finally:
        watcher.join(60.0)
    assert codes == [0]
    snapshots = [json.loads(line) for line in (out + capsys.readouterr().out).splitlines()]
    assert len(snapshots) == 2
    assert [e["engine_id"] for e in snapshots[-1]["engines"]] == ["p-first", "p-second"]
