"""kvwire.logs: context on every record, as attributes and as a message suffix."""

from __future__ import annotations

import json
import logging

import pytest

from kvwire.logs import JsonFormatter, get_logger


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvwire.test"]


def test_context_is_on_the_record_and_in_the_message(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvwire.test")
    log = get_logger("kvwire.test", engine="decode-0", role="consumer", transport="shm")
    log.info("handshake with %s failed", "prefill-0", extra={"peer": "10.0.0.5:5600"})
    (record,) = _records(caplog)
    assert record.getMessage() == (
        "handshake with prefill-0 failed "
        "[engine=decode-0 role=consumer transport=shm peer=10.0.0.5:5600]"
    )
    assert record.engine == "decode-0" and record.peer == "10.0.0.5:5600"  # type: ignore[attr-defined]
    assert record.kvwire == {  # type: ignore[attr-defined]
        "engine": "decode-0",
        "role": "consumer",
        "transport": "shm",
        "peer": "10.0.0.5:5600",
    }


def test_bind_adds_context_and_none_values_are_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvwire.test")
    log = get_logger("kvwire.test", engine="p", peer=None).bind(request_id="r-1")
    log.info("freed", extra={"peer": None})
    (record,) = _records(caplog)
    assert record.getMessage() == "freed [engine=p request_id=r-1]"
    assert not hasattr(record, "peer")


def test_a_percent_sign_in_context_does_not_break_formatting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kvwire.test")
    get_logger("kvwire.test", request_id="100%s").info("done %d", 3)
    (record,) = _records(caplog)
    assert record.getMessage() == "done 3 [request_id=100%s]"


def test_a_percent_sign_in_context_is_not_doubled_without_args(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call without args is never %-formatted, so its suffix must not be escaped."""
    caplog.set_level(logging.INFO, logger="kvwire.test")
    get_logger("kvwire.test", peer="fe80::1%eth0").info("gone")
    (record,) = _records(caplog)
    assert record.getMessage() == "gone [peer=fe80::1%eth0]"
    assert json.loads(JsonFormatter().format(record))["message"] == "gone"
    assert record.funcName == "test_a_percent_sign_in_context_is_not_doubled_without_args"


def test_json_formatter_gives_the_context_as_fields(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvwire.test")
    get_logger("kvwire.test", engine="e", rank="pp0/tp1").warning("lease of %s ran out", "r%")
    (record,) = _records(caplog)
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "lease of r% ran out"
    assert (line["engine"], line["rank"], line["level"]) == ("e", "pp0/tp1", "WARNING")
    assert line["logger"] == "kvwire.test"


def test_runtime_records_carry_engine_role_rank_and_transport(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Producer logs a failed handshake with its own context and the peer's address."""
    from kvwire_shm import allocate

    from kvwire.config import KVWireConfig
    from kvwire.demo.models import CacheSpec, preset
    from kvwire.runtime import Consumer

    caplog.set_level(logging.INFO, logger="kvwire.runtime")
    spec = CacheSpec(preset("llama-3-8b"), 1, 8, 0, 1)
    buffer = allocate(spec.total_bytes)
    config = KVWireConfig(
        engine_id="decode-ctx",
        compat=spec.compat("pull"),
        handshake_timeout_s=0.2,
        handshake_retries=0,
    )
    with Consumer(config, "shm") as consumer:
        consumer.register_kv_caches(spec.geometry(int(buffer.ctypes.data)))
        params = {
            "do_remote_prefill": True,
            "remote_block_ids": [[0]],
            "remote_engine_id": "prefill-gone",
            "remote_request_id": "r",
            "remote_host": "127.0.0.1",
            "remote_port": 1,  # nothing listens there
        }
        consumer.add_request("r", params, [[1]])
        assert consumer.wait_finished(30.0)
    handshake = [r for r in caplog.records if r.getMessage().startswith("handshake with")]
    assert handshake, [r.getMessage() for r in caplog.records]
    ctx = handshake[0].kvwire  # type: ignore[attr-defined]
    assert ctx == {
        "engine": "decode-ctx",
        "role": "consumer",
        "rank": "pp0/tp0",
        "transport": "shm",
        "peer": "127.0.0.1:1",
    }
    failed = [r for r in caplog.records if r.getMessage().startswith("request failed")]
    assert failed and failed[0].request_id == "r"  # type: ignore[attr-defined]
