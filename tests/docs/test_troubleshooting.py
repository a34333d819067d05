"""The troubleshooting page's error messages are what kvwire really prints.

The page (docs/troubleshooting.md) is parsed: every ``## N. Title`` section is one failure
and every ```text block in it a message, with ``<placeholders>`` standing for values that
vary. For each section a trigger below causes that failure through the public API or the
CLI and returns what kvwire printed (log lines, exception messages, stderr); each of the
section's blocks must match one of them.
"""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kvwire_shm import allocate

from kvwire.cli import main as cli_main
from kvwire.config import KVWireConfig
from kvwire.demo.models import CacheSpec, preset
from kvwire.errors import HandshakeError, TransportUnavailableError, WireDecodeError
from kvwire.runtime import Consumer, Producer
from kvwire.sidechannel import HandshakeListener
from kvwire.transport import create
from kvwire.wire.compat import CompatFactors

PAGE = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
SECTION = re.compile(r"^## (\d+)\. (.+)$", re.MULTILINE)
TEXT_BLOCK = re.compile(r"^```text\n(.*?)\n```$", re.MULTILINE | re.DOTALL)
PLACEHOLDER = re.compile(r"<[a-z_ ]+>")


def page_entries() -> dict[int, tuple[str, list[str]]]:
    text = PAGE.read_text()
    heads = list(SECTION.finditer(text))
    out: dict[int, tuple[str, list[str]]] = {}
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        blocks = TEXT_BLOCK.findall(text, head.end(), end)
        out[int(head.group(1))] = (head.group(2), [b.strip() for b in blocks])
    return out


def as_pattern(line: str) -> re.Pattern[str]:
    """The page's line with each <placeholder> matching any non-empty text."""
    parts = PLACEHOLDER.split(line)
    return re.compile(".+?".join(re.escape(p) for p in parts))


# -- a P/D pair over shm, failing in a chosen way ------------------------------------------

_keep: list[Any] = []  # KV memory must outlive the agents that registered it


def _side(tp_rank: int = 0, tp_size: int = 1, layers: int = 2) -> tuple[CacheSpec, Any]:
    spec = CacheSpec(preset("llama-3-8b"), layers, 16, tp_rank, tp_size)
    buffer = allocate(spec.total_bytes)
    _keep.append(buffer)
    return spec, buffer


def _compat(version: int = 13, mode: str = "pull", **changes: Any) -> CompatFactors:
    base = CacheSpec(preset("llama-3-8b"), 2, 16, 0, 1).compat(mode)
    return msgspec.structs.replace(base, nixl_connector_version=version, **changes)


def run_pair(
    caplog: pytest.LogCaptureFixture,
    *,
    p_compat: CompatFactors | None = None,
    d_compat: CompatFactors | None = None,
    p_version: int = 13,
    d_mode: str = "pull",
    p_tp_size: int = 1,
    d_layers: int = 2,
    close_p_listener: bool = False,
    edit_params: Callable[[dict[str, Any]], None] | None = None,
) -> list[str]:
    """One request from P to D; returns D's runtime log lines and the failure's detail."""
    caplog.set_level(logging.INFO, logger="kvwire.runtime")
    p_spec, p_buf = _side(tp_size=p_tp_size)
    d_spec, d_buf = _side(layers=d_layers)
    policy = {"handshake_timeout_s": 0.5, "handshake_retries": 0, "handshake_backoff_s": 0.01}
    made: list[Any] = []
    try:
        p_listener = HandshakeListener({}).start()
        made.append(p_listener)
        producer = Producer(
            KVWireConfig(
                engine_id="prefill-t",
                tp_size=p_tp_size,
                version=p_version,
                side_channel_port=p_listener.port,
                compat=p_compat or _compat(),
                **policy,
            ),
            "shm",
        )
        made.append(producer)
        consumer = Consumer(
            KVWireConfig(
                engine_id="decode-t",
                mode=d_mode,  # type: ignore[arg-type]
                compat=d_compat or _compat(mode=d_mode),
                **policy,
            ),
            "shm",
        )
        made.append(consumer)
        producer.register_kv_caches(p_spec.geometry(int(p_buf.ctypes.data)))
        consumer.register_kv_caches(d_spec.geometry(int(d_buf.ctypes.data)))
        p_listener.set_payloads({(0, 0): producer.handshake_payload()})
        params = producer.prefill_finished("req-t", [[0, 1]])
        if close_p_listener:
            p_listener.close()
        if edit_params is not None:
            edit_params(params)
        consumer.add_request("req-t", params, [[2, 3]])
        deadline = time.monotonic() + 30
        finished = consumer.get_finished()
        while not finished and time.monotonic() < deadline:
            consumer.wait_finished(0.05)
            finished = consumer.get_finished()
        assert "req-t" in finished.failed, f"the request did not fail: {finished}"
        detail = finished.failed["req-t"].detail
    finally:
        for thing in reversed(made):
            thing.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvwire.runtime"]
    return [*lines, detail]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    code = cli_main(list(argv))
    assert code == 2
    return capsys.readouterr().err.splitlines()


# -- one trigger per entry ---------------------------------------------------------------


def hash_mismatch(caplog: Any, capsys: Any) -> list[str]:
    return run_pair(caplog, d_compat=_compat(cache_dtype="fp8"))


def mode_mismatch(caplog: Any, capsys: Any) -> list[str]:
    return run_pair(caplog, d_mode="push")


def version_mismatch(caplog: Any, capsys: Any) -> list[str]:
    return run_pair(caplog, p_version=14, p_compat=_compat(version=14))


def unreachable(caplog: Any, capsys: Any) -> list[str]:
    lines = run_pair(caplog, close_p_listener=True)
    port = _free_port()
    lines += _cli(capsys, "probe", f"127.0.0.1:{port}")
    lines += _cli(capsys, "probe", "no-such-host.invalid:5600")
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        lines += _cli(capsys, "probe", address, "--timeout", "0.3", "--retries", "0")
    return lines


def missing_rank(caplog: Any, capsys: Any) -> list[str]:
    return run_pair(caplog, p_tp_size=2)


def geometry_mismatch(caplog: Any, capsys: Any) -> list[str]:
    return run_pair(caplog, d_layers=3)


def expired(caplog: Any, capsys: Any) -> list[str]:
    def soon(params: dict[str, Any]) -> None:  # as a vLLM 0.33 producer stamps it
        params["remote_blocks_expiry_time"] = time.perf_counter() + 1.0

    return run_pair(caplog, edit_params=soon)


def malformed_params(caplog: Any, capsys: Any) -> list[str]:
    spec, buf = _side()
    with Consumer(KVWireConfig(engine_id="decode-m", compat=_compat()), "shm") as consumer:
        consumer.register_kv_caches(spec.geometry(int(buf.ctypes.data)))
        params = {
            "do_remote_prefill": True,
            "remote_block_ids": [[0]],
            "remote_request_id": "r",
            "remote_host": "10.0.0.5",
            "remote_port": 5600,
        }
        with pytest.raises(WireDecodeError) as info:
            consumer.add_request("r", params, [[1]])
    return [str(info.value)]


def port_taken(caplog: Any, capsys: Any) -> list[str]:
    with HandshakeListener({}) as first, pytest.raises(HandshakeError) as info:
        HandshakeListener({}, port=first.port).start()
    return [str(info.value)]


def transport_missing(caplog: Any, capsys: Any) -> list[str]:
    hide_nixl = (
        "import sys\n"
        "for name in ('nixl_cu12', 'nixl_cu13', 'nixl'):\n"
        "    sys.modules[name] = None  # this interpreter cannot import NIXL\n"
        "from kvwire.transport import create\n"
        "from kvwire.errors import TransportUnavailableError\n"
        "try:\n"
        "    create('nixl', 'agent')\n"
        "except TransportUnavailableError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", hide_nixl], capture_output=True, text=True, timeout=120
    )
    with pytest.raises(TransportUnavailableError) as info:
        create("nxil", "agent")
    return [*out.stdout.splitlines(), str(info.value)]


TRIGGERS: dict[int, Callable[[Any, Any], list[str]]] = {
    1: hash_mismatch,
    2: mode_mismatch,
    3: version_mismatch,
    4: unreachable,
    5: missing_rank,
    6: geometry_mismatch,
    7: expired,
    8: malformed_params,
    9: port_taken,
    10: transport_missing,
}


def test_the_page_lists_ten_failures_each_with_a_trigger() -> None:
    entries = page_entries()
    assert sorted(entries) == list(range(1, 11))
    assert set(entries) == set(TRIGGERS)
    for number, (title, blocks) in entries.items():
        assert blocks, f"entry {number} ({title}) shows no error text"


@pytest.fixture(autouse=True)
def _release_memory() -> Iterator[None]:
    yield
    _keep.clear()


@pytest.mark.parametrize("number", sorted(TRIGGERS))
def test_each_error_on_the_page_is_what_kvwire_prints(
    number: int, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    title, blocks = page_entries()[number]
    printed = TRIGGERS[number](caplog, capsys)
    for block in blocks:
        pattern = as_pattern(block)
        assert any(pattern.search(line) for line in printed), (
            f"troubleshooting entry {number} ({title}) shows\n  {block}\n"
            f"but kvwire printed:\n  " + "\n  ".join(printed)
        )


def test_placeholders_do_not_match_across_everything() -> None:
    """A page line made only of placeholders would match anything: keep text around them."""
    for number, (_, blocks) in page_entries().items():
        for block in blocks:
            literal = PLACEHOLDER.sub("", block)
            assert len(literal) >= 20, f"entry {number}: too little literal text in {block!r}"
