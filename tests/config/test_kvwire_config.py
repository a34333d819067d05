"""KVWireConfig: the one configuration. Defaults, KVWIRE_* variables, a config file, vLLM's
kv_transfer_config, the documented precedence on every path, and errors naming their source."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from kvwire.config import ENV_VARS, KNOBS, VLLM_EXTRA_CONFIG_KEYS, KVWireConfig, RetryPolicy
from kvwire.errors import ConfigError
from kvwire.machine import ConsumerMachine, ProducerMachine

# A valid, non-default raw value for every variable, and the typed value it must become.
SAMPLES: dict[str, tuple[str, Any]] = {
    "KVWIRE_ENGINE_ID": ("prefill-7", "prefill-7"),
    "KVWIRE_MODE": ("PUSH", "push"),
    "KVWIRE_PROTOCOL_VERSION": ("15", 15),
    "KVWIRE_TRANSPORT": ("nixl", "nixl"),
    "KVWIRE_TRANSPORT_OPTIONS": ('{"progress": "inline"}', {"progress": "inline"}),
    "KVWIRE_SIDE_CHANNEL_HOST": ("10.1.2.3", "10.1.2.3"),
    "KVWIRE_SIDE_CHANNEL_PORT": ("5601", 5601),
    "KVWIRE_ADVERTISE_HOST": ("p.example", "p.example"),
    "KVWIRE_ENFORCE_COMPAT": ("off", False),
    "KVWIRE_COMPAT_HASH": ("abc123", "abc123"),
    "KVWIRE_SECRET_FILE": (None, None),  # read at once: tested with a real file below
    "KVWIRE_LEASE_S": ("90", 90.0),
    "KVWIRE_HEARTBEAT_INTERVAL_S": ("2.5", 2.5),
    "KVWIRE_REGISTRATION_TIMEOUT_S": ("12", 12.0),
    "KVWIRE_ENGINE_IDLE_TTL_S": ("600", 600.0),
    "KVWIRE_EXPIRY_MARGIN_S": ("2", 2.0),
    "KVWIRE_COMPLETION_MARGIN_S": ("0.5", 0.5),
    "KVWIRE_LEASE_GRACE_S": ("10", 10.0),
    "KVWIRE_TRANSFER_TIMEOUT_S": ("45", 45.0),
    "KVWIRE_HANDSHAKE_TIMEOUT_S": ("1.5", 1.5),
    "KVWIRE_HANDSHAKE_RETRIES": ("0", 0),
    "KVWIRE_HANDSHAKE_BACKOFF_S": ("0", 0.0),
    "KVWIRE_POLL_INTERVAL_S": ("0.005", 0.005),
    "KVWIRE_COALESCE": ("false", False),
    "KVWIRE_STREAM_LAYERS": ("false", False),
    "KVWIRE_CHECK_INVARIANTS": ("0", False),
    "KVWIRE_MAX_PARKED_COMPLETIONS": ("500", 500),
    "KVWIRE_RELEASE_RETRY_S": ("2", 2.0),
    "KVWIRE_METRICS_PORT": ("9400", 9400),
    "KVWIRE_LOG_LEVEL": ("debug", "DEBUG"),
    "KVWIRE_METADATA_STORE": ("etcd://etcd.example:2379/", "etcd://etcd.example:2379"),
    "KVWIRE_METADATA_STORE_TTL_S": ("30", 30.0),
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
    "KVWIRE_TRANSFER_TIMEOUT_S": "-5",
    "KVWIRE_HANDSHAKE_TIMEOUT_S": "nan",
    "KVWIRE_HANDSHAKE_RETRIES": "1.5",
    "KVWIRE_HANDSHAKE_BACKOFF_S": "-0.1",
    "KVWIRE_POLL_INTERVAL_S": "1e12",
    "KVWIRE_COALESCE": "2",
    "KVWIRE_STREAM_LAYERS": "sometimes",
    "KVWIRE_MAX_PARKED_COMPLETIONS": "0",
    "KVWIRE_RELEASE_RETRY_S": "never",
    "KVWIRE_METRICS_PORT": "0",
    "KVWIRE_LOG_LEVEL": "loud",
    "KVWIRE_METADATA_STORE": "redis://cache:6379",
    "KVWIRE_METADATA_STORE_TTL_S": "1",
}


def cfg(environ: dict[str, str] | None = None, **given: Any) -> KVWireConfig:
    return KVWireConfig(environ=environ or {}, **given)


def test_every_variable_has_a_sample() -> None:
    assert set(SAMPLES) == set(ENV_VARS)


@pytest.mark.parametrize("var", sorted(v for v, (raw, _) in SAMPLES.items() if raw))
def test_each_variable_sets_its_field(var: str) -> None:
    raw, expected = SAMPLES[var]
    name = ENV_VARS[var]
    assert getattr(cfg({var: raw}), name) == expected
    assert getattr(cfg(), name) != expected  # the sample is not the default


@pytest.mark.parametrize("var", sorted(BAD))
def test_a_bad_value_is_a_config_error_naming_the_variable(var: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg({var: BAD[var]})
    message = str(info.value)
    assert message.startswith(f"{var}={BAD[var]!r}: expected")
    assert "\n" not in message


def test_empty_variables_count_as_unset() -> None:
    assert cfg({"KVWIRE_LEASE_S": "  ", "KVWIRE_MODE": ""}) == cfg()


def test_the_handshake_policy_follows_the_variables() -> None:
    env = {"KVWIRE_HANDSHAKE_TIMEOUT_S": "1", "KVWIRE_HANDSHAKE_RETRIES": "0"}
    assert cfg(env, engine_id="e").handshake == RetryPolicy(timeout=1.0, retries=0)
    assert cfg(engine_id="e").handshake == RetryPolicy(timeout=5.0, retries=2)


def test_os_environ_is_read_when_built_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The path the README teaches: no environ passed, the process's variables apply."""
    monkeypatch.setenv("KVWIRE_HANDSHAKE_TIMEOUT_S", "1")
    monkeypatch.setenv("KVWIRE_HANDSHAKE_RETRIES", "0")
    config = KVWireConfig(engine_id="prefill-0")
    assert (config.handshake_timeout_s, config.handshake_retries) == (1.0, 0)
    assert config.handshake_budget_s() < 3


def test_the_machines_run_on_the_same_object() -> None:
    env = {var: raw for var, (raw, _) in SAMPLES.items() if raw}
    env["KVWIRE_MODE"] = "pull"
    config = cfg(env, tp_rank=1, tp_size=2)
    consumer = ConsumerMachine(config, host="10.1.2.3", port=5601)
    producer = ProducerMachine(config)
    assert consumer.config is config and producer.config is config
    assert (consumer.host, consumer.port, consumer.one_source) == ("10.1.2.3", 5601, False)
    # What the environment set is what the machine runs on: lease 90 s, heartbeat 2.5 s,
    # margins 2 s / 0.5 s, grace 10 s, transfer timeout 45 s, a handshake of 1.5 s + 1 s.
    assert (config.heartbeat_s, config.expiry_margin, config.completion_margin) == (2.5, 2, 0.5)
    assert (config.lease_grace, config.transfer_timeout) == (10, 45)
    assert config.handshake_budget_s() == 2.5
    assert (config.max_parked_completions, config.release_retry_s) == (500, 2.0)


def test_the_secret_is_read_from_the_file_the_variable_names(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    config = cfg({"KVWIRE_SECRET_FILE": str(secret)})
    assert config.secret == b"0123456789abcdef0123456789abcdef"
    assert "0123456789abcdef" not in repr(config) + str(config.as_env())
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by every user"):
        cfg({"KVWIRE_SECRET_FILE": str(secret)})


def test_a_runtime_needs_an_engine_id() -> None:
    from kvwire.runtime import Producer

    with pytest.raises(ConfigError, match="KVWIRE_ENGINE_ID"):
        Producer(cfg())


def test_unknown_fields_are_config_errors_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"'lease_seconds' \(did you mean lease_s"):
        cfg(lease_seconds=3)


def test_unknown_kvwire_variables_are_warned_about_with_a_suggestion(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvwire.config")
    cfg({"KVWIRE_LEASE": "5", "KVWIRE_CONFIG": "", "OTHER": "x"})
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "ignoring unknown environment variable KVWIRE_LEASE (did you mean KVWIRE_LEASE_S?)"
    ]


def test_replace_keeps_every_value_and_ignores_the_environment() -> None:
    base = cfg(engine_id="e", lease_s=7)
    again = dataclasses.replace(base, handshake_retries=0)
    assert (again.engine_id, again.lease_s, again.handshake_retries) == ("e", 7, 0)


# -- the precedence: explicit > environment > vLLM > file > default --------------------------


def test_layers_apply_in_the_documented_order(tmp_path: Path) -> None:
    path = tmp_path / "kvwire.toml"
    path.write_text(
        "lease_s = 10\nengine_idle_ttl_s = 11\nregistration_timeout_s = 12\npoll_interval_s = 0.5\n"
    )
    vllm = {
        "kv_connector_extra_config": {
            "kv_lease_duration": 20,
            "engine_ttl": 21,
            "push_registration_timeout": 22,
        }
    }
    env = {"KVWIRE_LEASE_S": "30", "KVWIRE_ENGINE_IDLE_TTL_S": "31", "KVWIRE_CONFIG": str(path)}
    config = KVWireConfig(environ=env, kv_transfer_config=vllm, lease_s=40)
    assert config.lease_s == 40  # explicit over everything
    assert config.engine_idle_ttl_s == 31  # environment over vLLM and the file
    assert config.registration_timeout_s == 22  # vLLM over the file
    assert config.poll_interval_s == 0.5  # the file over the default
    assert config.handshake_timeout_s == 5.0  # the default


def test_a_json_config_file_and_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "kvwire.json"
    path.write_text(json.dumps({"mode": "push", "transport": "ucx"}))
    config = KVWireConfig(environ={}, config_file=path)
    assert (config.mode, config.transport) == ("push", "ucx")
    path.write_text(json.dumps({"leas_s": 3}))
    with pytest.raises(ConfigError, match=r"unknown setting 'leas_s' \(did you mean lease_s"):
        KVWireConfig(environ={"KVWIRE_CONFIG": str(path)})
    path.write_text(json.dumps({"lease_s": -3}))
    with pytest.raises(ConfigError, match="lease_s=-3: expected"):
        KVWireConfig(environ={}, config_file=path)
    with pytest.raises(ConfigError, match="cannot read config file"):
        KVWireConfig(environ={}, config_file=tmp_path / "missing.toml")


# -- vLLM's kv_transfer_config ------------------------------------------------------------------


def test_the_connector_name_gives_the_mode() -> None:
    push = cfg(kv_transfer_config={"kv_connector": "NixlPushConnector", "kv_role": "kv_both"})
    assert (push.mode, push.transport) == ("push", "nixl")
    assert cfg(kv_transfer_config={"kv_connector": "NixlConnector"}).mode == "pull"
    text = json.dumps({"kv_connector": "NixlPushConnector", "engine_id": "p9"})
    assert (cfg(kv_transfer_config=text).mode, cfg(kv_transfer_config=text).engine_id) == (
        "push",
        "p9",
    )
    with pytest.raises(ConfigError, match="LMCacheConnector"):
        cfg(kv_transfer_config={"kv_connector": "LMCacheConnectorV1"})


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
    config = cfg(kv_transfer_config={"kv_connector_extra_config": extra}, engine_id="p")
    assert config.lease_s == 45 and config.enforce_compat is False
    assert config.engine_idle_ttl_s == 120
    assert config.registration_timeout_s == 20  # push_registration_timeout wins, as in vLLM
    assert config.transport_kwargs() == {"backend": "UCX", "num_threads": 8}


def test_decoder_kv_blocks_ttl_is_the_registration_timeout_when_alone() -> None:
    config = cfg(kv_transfer_config={"kv_connector_extra_config": {"decoder_kv_blocks_ttl": 300}})
    assert config.registration_timeout_s == 300


def test_every_vllm_key_changes_something(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 32)
    secret.chmod(0o600)
    samples: dict[str, Any] = {
        "kv_lease_duration": 45,
        "enforce_handshake_compat": False,
        "engine_ttl": 120,
        "push_registration_timeout": 20,
        "decoder_kv_blocks_ttl": 480,
        "backends": ["POSIX"],
        "num_threads": 2,
        "transport": "nixl",  # the default is shm
        "transfer_mode": "push",
        "transport_options": {"backend": "POSIX"},
        "secret_file": str(secret),
        "coalesce": False,
        "stream_layers": False,  # on by default
        "handshake_timeout": 2,
        "metrics_port": 9400,
        "metadata_store": "etcd://10.0.0.5:2379",
        "metadata_store_ttl": 20,
    }
    assert set(samples) == set(VLLM_EXTRA_CONFIG_KEYS)
    for key, value in samples.items():
        changed = cfg(kv_transfer_config={"kv_connector_extra_config": {key: value}})
        assert changed != cfg(), key


def test_kvwire_connector_name_takes_mode_and_transport_from_extra_config() -> None:
    """kvwire's own vLLM connector: the name says nothing of the mode; default pull/nixl."""
    plain = cfg(kv_transfer_config={"kv_connector": "KVWireConnector"})
    assert (plain.mode, plain.transport) == ("pull", "nixl")
    extra = {"transport": "shm", "transfer_mode": "push", "handshake_timeout": 2}
    chosen = cfg(
        kv_transfer_config={"kv_connector": "KVWireConnector", "kv_connector_extra_config": extra}
    )
    assert (chosen.mode, chosen.transport, chosen.handshake_timeout_s) == ("push", "shm", 2.0)


def test_unknown_vllm_keys_are_warned_about_with_a_suggestion(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvwire.config")
    whole = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_conector_extra_config": {},
        "kv_connector_extra_config": {"kv_lease_durration": 60, "bidirectional_kv_xfer": True},
    }
    config = cfg(kv_transfer_config=whole)
    assert config.lease_s == 30.0  # the misspelt key did nothing ...
    assert [r.getMessage() for r in caplog.records] == [  # ... and said so
        "ignoring unknown kv_transfer_config key 'kv_conector_extra_config' "
        "(did you mean kv_connector_extra_config?)",
        "ignoring unknown kv_connector_extra_config key 'kv_lease_durration' "
        "(did you mean kv_lease_duration?)",
    ]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("kv_lease_duration", "long"),
        ("enforce_handshake_compat", "perhaps"),
        ("backends", ["UCX", "GDS"]),
        ("backends", []),
        ("num_threads", -1),
        ("metadata_store", "etcd://host:port"),
    ],
)
def test_bad_vllm_values_name_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        cfg(kv_transfer_config={"kv_connector_extra_config": {key: value}})
    assert str(info.value).startswith(f"kv_connector_extra_config[{key!r}]={value!r}: ")


@pytest.mark.parametrize(
    "raw",
    ["etcd:/h:1", "http://h:2379", "etcd://:2379", "etcd://h:0", "etcd://h:99999", "etcd://u@h:1"],
)
def test_a_bad_metadata_store_address_is_one_line(raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        cfg(metadata_store=raw)
    assert str(info.value).startswith(f"metadata_store={raw!r}: expected")
    assert "\n" not in str(info.value)


def test_a_metadata_store_address_is_normalized() -> None:
    assert cfg(metadata_store="etcd://10.0.0.5").metadata_store == "etcd://10.0.0.5:2379"
    assert cfg(metadata_store="ETCD://[::1]:2380").metadata_store == "etcd://[::1]:2380"
    assert cfg(metadata_store="").metadata_store is None


def test_as_env_reproduces_the_configuration() -> None:
    config = cfg(
        engine_id="p-1",
        mode="push",
        lease_s=12.5,
        compat_hash="ff",
        kv_transfer_config={"kv_connector_extra_config": {"backends": ["UCX"]}},
    )
    again = cfg(config.as_env())
    assert again == config
    assert set(KNOBS) >= set(ENV_VARS.values())


def test_a_runtime_configured_from_the_environment_serves_requests() -> None:
    """The configuration reaches the runtime: P advertises the host and port from the
    environment and holds blocks under the lease from it."""
    from kvwire_shm import allocate

    from kvwire.demo.models import CacheSpec, preset
    from kvwire.runtime import Producer

    spec = CacheSpec(preset("llama-3-8b"), 1, 8, 0, 1)
    buffer = allocate(spec.total_bytes)
    config = cfg(
        {
            "KVWIRE_ENGINE_ID": "prefill-env",
            "KVWIRE_TRANSPORT": "shm",
            "KVWIRE_ADVERTISE_HOST": "10.9.8.7",
            "KVWIRE_SIDE_CHANNEL_PORT": "5611",
            "KVWIRE_LEASE_S": "0.2",
        },
        compat=spec.compat("pull"),
    )
    with Producer(config) as producer:
        producer.register_kv_caches(spec.geometry(int(buffer.ctypes.data)))
        params = producer.prefill_finished("r", [[0]])
        assert (params["remote_host"], params["remote_port"]) == ("10.9.8.7", 5611)
        assert params["remote_engine_id"] == "prefill-env"
        assert producer.wait_finished(30.0)  # the 0.2 s lease runs out
        assert [f.reason for f in producer.get_finished()] == ["expired"]
