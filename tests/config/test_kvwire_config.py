"""KVWireConfig: defaults, KVWIRE_* overrides, vLLM's extra config, and errors that name
their source."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest

from kvwire.config import ENV_VARS, VLLM_EXTRA_CONFIG_KEYS, KVWireConfig
from kvwire.errors import ConfigError
from kvwire.runtime import RuntimeConfig
from kvwire.sidechannel import RetryPolicy

# A valid, non-default raw value for every variable, and the typed value it must become.
SAMPLES: dict[str, tuple[str, Any]] = {
    "KVWIRE_ENGINE_ID": ("prefill-7", "prefill-7"),
    "KVWIRE_MODE": ("PUSH", "push"),
    "KVWIRE_PROTOCOL_VERSION": ("15", 15),
    "KVWIRE_TRANSPORT": ("shm", "shm"),
    "KVWIRE_TRANSPORT_OPTIONS": ('{"progress": "inline"}', {"progress": "inline"}),
    "KVWIRE_SIDE_CHANNEL_HOST": ("10.1.2.3", "10.1.2.3"),
    "KVWIRE_SIDE_CHANNEL_PORT": ("5601", 5601),
    "KVWIRE_ENFORCE_COMPAT": ("off", False),
    "KVWIRE_COMPAT_HASH": ("abc123", "abc123"),
    "KVWIRE_SECRET_FILE": ("/run/kvwire/secret", "/run/kvwire/secret"),
    "KVWIRE_LEASE_S": ("90", 90.0),
    "KVWIRE_HEARTBEAT_INTERVAL_S": ("2.5", 2.5),
    "KVWIRE_REGISTRATION_TIMEOUT_S": ("12", 12.0),
    "KVWIRE_ENGINE_IDLE_TTL_S": ("600", 600.0),
    "KVWIRE_HANDSHAKE_TIMEOUT_S": ("1.5", 1.5),
    "KVWIRE_HANDSHAKE_RETRIES": ("0", 0),
    "KVWIRE_HANDSHAKE_BACKOFF_S": ("0", 0.0),
    "KVWIRE_POLL_INTERVAL_S": ("0.005", 0.005),
    "KVWIRE_COALESCE": ("false", False),
    "KVWIRE_CHECK_INVARIANTS": ("0", False),
}

BAD: dict[str, str] = {
    "KVWIRE_ENGINE_ID": "a,b",
    "KVWIRE_MODE": "sideways",
    "KVWIRE_PROTOCOL_VERSION": "12",
    "KVWIRE_TRANSPORT_OPTIONS": "[1, 2]",
    "KVWIRE_SIDE_CHANNEL_PORT": "70000",
    "KVWIRE_ENFORCE_COMPAT": "maybe",
    "KVWIRE_LEASE_S": "soon",
    "KVWIRE_HEARTBEAT_INTERVAL_S": "-1",
    "KVWIRE_REGISTRATION_TIMEOUT_S": "0",
    "KVWIRE_ENGINE_IDLE_TTL_S": "inf",
    "KVWIRE_HANDSHAKE_TIMEOUT_S": "nan",
    "KVWIRE_HANDSHAKE_RETRIES": "1.5",
    "KVWIRE_HANDSHAKE_BACKOFF_S": "-0.1",
    "KVWIRE_POLL_INTERVAL_S": "0",
    "KVWIRE_COALESCE": "2",
    "KVWIRE_CHECK_INVARIANTS": "",  # empty means unset, checked separately
}


def test_every_variable_has_a_sample() -> None:
    assert set(SAMPLES) == set(ENV_VARS)


@pytest.mark.parametrize("var", sorted(ENV_VARS))
def test_each_variable_overrides_its_field(var: str) -> None:
    raw, expected = SAMPLES[var]
    field_name = ENV_VARS[var][0]
    cfg = KVWireConfig.from_env({var: raw})
    assert getattr(cfg, field_name) == expected
    assert getattr(KVWireConfig(), field_name) != expected  # the sample is not the default


@pytest.mark.parametrize("var", sorted(v for v, raw in BAD.items() if raw))
def test_a_bad_value_is_a_config_error_naming_the_variable(var: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVWireConfig.from_env({var: BAD[var]})
    message = str(info.value)
    assert message.startswith(f"{var}={BAD[var]!r}: expected")
    assert "\n" not in message


def test_empty_variables_count_as_unset() -> None:
    assert KVWireConfig.from_env({"KVWIRE_LEASE_S": "  ", "KVWIRE_MODE": ""}) == KVWireConfig()


def test_the_runtime_config_carries_every_value() -> None:
    env = {var: raw for var, (raw, _) in SAMPLES.items()}
    env["KVWIRE_MODE"] = "pull"  # push would need push factors; the mode itself is tested above
    del env["KVWIRE_SECRET_FILE"]  # loading it is tested below
    rc = KVWireConfig.from_env(env, tp_rank=1, tp_size=2).runtime_config()
    assert isinstance(rc, RuntimeConfig)
    assert (rc.engine_id, rc.version, rc.tp_rank, rc.tp_size) == ("prefill-7", 15, 1, 2)
    assert (rc.side_channel_host, rc.side_channel_port) == ("10.1.2.3", 5601)
    assert (rc.lease_s, rc.heartbeat_interval_s, rc.registration_timeout_s) == (90, 2.5, 12)
    assert rc.engine_idle_ttl_s == 600 and rc.poll_interval_s == 0.005
    assert rc.handshake == RetryPolicy(timeout=1.5, retries=0, backoff=0.0)
    assert not rc.enforce_compat and not rc.coalesce and not rc.check_invariants
    assert rc.compat_hash == "abc123"


def test_defaults_match_the_runtime_defaults() -> None:
    ours = KVWireConfig(engine_id="e").runtime_config()
    assert ours == RuntimeConfig(engine_id="e")


def test_the_secret_is_read_from_the_file_the_variable_names(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    cfg = KVWireConfig.from_env({"KVWIRE_SECRET_FILE": str(secret), "KVWIRE_ENGINE_ID": "e"})
    assert cfg.runtime_config().secret == b"0123456789abcdef0123456789abcdef"
    assert "0123456789abcdef" not in repr(cfg) + str(cfg.as_env())
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by every user"):
        cfg.runtime_config()


def test_runtime_config_needs_an_engine_id() -> None:
    with pytest.raises(ConfigError, match="KVWIRE_ENGINE_ID"):
        KVWireConfig().runtime_config()


def test_unknown_fields_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="lease_seconds"):
        KVWireConfig.from_env({}, lease_seconds=3)


def test_unknown_kvwire_variables_are_warned_about_with_a_suggestion(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvwire.config")
    KVWireConfig.from_env({"KVWIRE_LEASE": "5", "KVWIRE_DEMO_LOG": "INFO", "OTHER": "x"})
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "ignoring unknown environment variable KVWIRE_LEASE (did you mean KVWIRE_LEASE_S?)"
    ]


# -- vLLM's kv_connector_extra_config ------------------------------------------------------


def test_vllm_keys_map_onto_kvwire_fields() -> None:
    extra = {
        "kv_lease_duration": 45,
        "enforce_handshake_compat": False,
        "engine_ttl": 120.0,
        "push_registration_timeout": 20,
        "decoder_kv_blocks_ttl": 480,
        "backends": ["UCX"],
        "num_threads": 8,
        "bidirectional_kv_xfer": True,  # no kvwire meaning: ignored
        "kv_recompute_threshold": 64,  # no kvwire meaning: ignored
    }
    cfg = KVWireConfig.from_vllm_extra_config(extra, engine_id="p")
    assert cfg.lease_s == 45 and cfg.enforce_compat is False and cfg.engine_idle_ttl_s == 120
    assert cfg.registration_timeout_s == 20  # push_registration_timeout wins, as in vLLM
    assert cfg.nixl_options == {"backend": "UCX", "num_threads": 8}
    assert cfg.transport_kwargs() == {"backend": "UCX", "num_threads": 8}
    assert dataclasses.replace(cfg, transport="shm").transport_kwargs() == {}


def test_decoder_kv_blocks_ttl_is_the_registration_timeout_when_alone() -> None:
    cfg = KVWireConfig.from_vllm_extra_config({"decoder_kv_blocks_ttl": 300})
    assert cfg.registration_timeout_s == 300


def test_every_vllm_key_changes_something() -> None:
    samples: dict[str, Any] = {
        "kv_lease_duration": 45,
        "enforce_handshake_compat": False,
        "engine_ttl": 120,
        "push_registration_timeout": 20,
        "decoder_kv_blocks_ttl": 480,
        "backends": ["POSIX"],
        "num_threads": 2,
    }
    assert set(samples) == set(VLLM_EXTRA_CONFIG_KEYS)
    for key, value in samples.items():
        assert KVWireConfig.from_vllm_extra_config({key: value}) != KVWireConfig(), key


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("kv_lease_duration", "long"),
        ("enforce_handshake_compat", "perhaps"),
        ("backends", ["UCX", "GDS"]),
        ("backends", []),
        ("num_threads", -1),
    ],
)
def test_bad_vllm_values_name_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        KVWireConfig.from_vllm_extra_config({key: value})
    assert str(info.value).startswith(f"kv_connector_extra_config[{key!r}]={value!r}: ")


def test_layers_apply_in_order_fields_then_vllm_then_environment() -> None:
    cfg = KVWireConfig.load(
        engine_id="from-engine",
        lease_s=10,
        handshake_timeout_s=3,
        extra_config={"kv_lease_duration": 20, "engine_ttl": 50},
        environ={"KVWIRE_LEASE_S": "40", "KVWIRE_ENGINE_ID": "from-env"},
    )
    assert cfg.engine_id == "from-env"
    assert cfg.lease_s == 40  # environment over vLLM over fields
    assert cfg.engine_idle_ttl_s == 50  # vLLM over the default
    assert cfg.handshake_timeout_s == 3  # fields over the default


def test_as_env_reproduces_the_configuration() -> None:
    cfg = KVWireConfig.load(
        engine_id="p-1",
        mode="push",
        lease_s=12.5,
        compat_hash="ff",
        transport="nixl",
        extra_config={"backends": ["UCX"]},
        environ={},
    )
    again = KVWireConfig.from_env(cfg.as_env())
    assert again.transport_kwargs() == cfg.transport_kwargs() == {"backend": "UCX"}
    assert dataclasses.replace(again, transport_options={}) == dataclasses.replace(
        cfg, transport_options={}, nixl_options={}
    )


def test_a_runtime_configured_from_the_environment_serves_requests() -> None:
    """The configuration reaches the runtime: P advertises the host and port from the
    environment and holds blocks under the lease from it."""
    from kvwire_shm import allocate

    from kvwire.demo.models import CacheSpec, preset
    from kvwire.runtime import Producer

    spec = CacheSpec(preset("llama-3-8b"), 1, 8, 0, 1)
    buffer = allocate(spec.total_bytes)
    cfg = KVWireConfig.from_env(
        {
            "KVWIRE_ENGINE_ID": "prefill-env",
            "KVWIRE_TRANSPORT": "shm",
            "KVWIRE_SIDE_CHANNEL_HOST": "10.9.8.7",
            "KVWIRE_SIDE_CHANNEL_PORT": "5611",
            "KVWIRE_LEASE_S": "0.2",
        }
    )
    producer = Producer(
        cfg.runtime_config(compat=spec.compat("pull")),
        cfg.transport,
        transport_options=cfg.transport_kwargs(),
    )
    with producer:
        producer.register_kv_caches(spec.geometry(int(buffer.ctypes.data)))
        params = producer.prefill_finished("r", [[0]])
        assert (params["remote_host"], params["remote_port"]) == ("10.9.8.7", 5611)
        assert params["remote_engine_id"] == "prefill-env"
        assert producer.wait_finished(30.0)  # the 0.2 s lease runs out
        assert [f.reason for f in producer.get_finished()] == ["expired"]
