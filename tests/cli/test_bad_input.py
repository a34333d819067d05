"""Every subcommand meets bad input with one stderr line, exit status 2 and no traceback,
before it starts any process; connection failures say what happened.

The table is the contract: each row is a command line (and environment) a user might type
by mistake, and a piece of the one line that must name the cause. It runs in-process with
fd-level capture, so a child process's traceback would show up here too.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvwire.cli import COMMANDS
from kvwire.cli import main as cli_main

FACTORS = {
    "vllm_version": "0.31.0",
    "model": "meta-llama/Meta-Llama-3-8B",
    "dtype": "bfloat16",
    "num_kv_heads": 8,
    "head_size": 128,
    "num_hidden_layers": 32,
    "attn_backend_name": "FLASH_ATTN",
}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name, content in {
        "model5": json.dumps({"model": 5}),
        "notjson": "{nope",
        "list": "[1, 2]",
        "good": json.dumps(FACTORS),
        "empty": "",
        "garbage": "\x00\x01\x02 not a message",
        "config_bad": "lease_s = -1\n",
        "config_typo": "leas_s = 1\n",
    }.items():
        path = tmp_path / (f"{name}.toml" if name.startswith("config") else f"{name}.json")
        path.write_text(content)
        out[name] = str(path)
    out["missing"] = str(tmp_path / "missing.json")
    return out


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        yield int(held.getsockname()[1])


# (command line, environment, a piece of the one line)
TABLE: list[tuple[str, dict[str, str], str]] = [
    # demo: every workload value, names, transports, addresses
    ("demo --lease -1", {}, "--lease -1.0: expected a number of seconds >= 0"),
    ("demo --lease 0", {}, "--lease 0.0: expected a positive number of seconds"),
    ("demo --lease nan", {}, "--lease nan: expected a finite number"),
    ("demo --lease 1e300", {}, "--lease 1e+300: expected at most"),
    ("demo --lease soon", {}, "argument --lease: invalid float value: 'soon'"),
    ("demo --p-tp 0", {}, "--p-tp must be an integer from 1 to 64, got 0"),
    ("demo --d-tp -2", {}, "--d-tp must be an integer from 1 to 64, got -2"),
    ("demo --p-tp 3", {}, "TP 3 does not divide"),
    ("demo --tokens 0", {}, "--tokens must be an integer from 1"),
    ("demo --tokens 999999999", {}, "--tokens must be an integer from 1 to 1048576"),
    ("demo --concurrency 1000 --tokens 100000", {}, "GiB of KV cache per engine"),
    ("demo --requests -1", {}, "--requests must be an integer from 1"),
    ("demo --layers 1000", {}, "--layers must be"),
    ("demo --layers 2.5", {}, "argument --layers: invalid int value"),
    ("demo --model nope", {}, "unknown model 'nope'"),
    ("demo --mode sideways", {}, "argument --mode: invalid choice: 'sideways'"),
    ("demo --transport nope", {}, "no transport named 'nope'"),
    ("demo --transport os:path", {}, "'os:path' is a module, not a transport factory"),
    ("demo --transport json:dumps", {}, "'json:dumps' made a str, not a transport"),
    ("demo --transport json:JSONDecoder", {}, "'json:JSONDecoder' is not a transport class"),
    ("demo --transport no_such_module:X", {}, "cannot load transport 'no_such_module:X'"),
    ("demo", {"KVWIRE_TRANSPORT": "nope"}, "no transport named 'nope'"),
    ("demo", {"KVWIRE_MODE": "sideways"}, "KVWIRE_MODE='sideways': expected 'pull' or 'push'"),
    ("demo", {"KVWIRE_LEASE_S": "soon"}, "KVWIRE_LEASE_S='soon': expected a number"),
    ("demo --role prefill", {}, "--role prefill needs --listen HOST:PORT"),
    ("demo --role decode", {}, "--role decode needs --connect HOST:PORT"),
    ("demo --listen 127.0.0.1:7600", {}, "--listen and --connect go with --role"),
    ("demo --role prefill --listen 127.0.0.1:99999", {}, "port 99999 is outside 1-65535"),
    ("demo --role prefill --listen nocolon", {}, "expected HOST:PORT, got 'nocolon'"),
    ("demo --role prefill --listen 127.0.0.1:{taken}", {}, "Address already in use"),
    ("demo --role decode --connect 127.0.0.1:1", {}, "connection refused by 127.0.0.1:1"),
    ("demo --role decode --connect no-such-host.invalid:7600", {}, "cannot resolve host"),
    ("demo --secret-file {missing}", {}, "missing.json"),
    ("demo --engine --secret-file {missing}", {}, "--secret-file is not supported"),
    ("demo --engine --prompts 0", {}, "--prompts must be an integer from 1"),
    ("demo --engine --max-tokens -1", {}, "--max-tokens must be an integer from 1"),
    ("demo --engine --block-size 0", {}, "--block-size must be an integer from 1"),
    ("demo --engine --transport os:path", {}, "not a transport factory"),
    ("demo --engine", {"KVWIRE_TRANSPORT": "nope"}, "no transport named 'nope'"),
    # soak
    ("soak --seconds nan", {}, "--seconds must be a number of seconds"),
    ("soak --seconds -1", {}, "--seconds must be a number of seconds"),
    ("soak --kill-every 0", {}, "--kill-every must be positive"),
    ("soak --downtime 2 1", {}, "is not 0 <= low <= high"),
    ("soak --report-every 0", {}, "--report-every must be positive"),
    ("soak --seed -1", {}, "--seed must be >= 0"),
    ("soak --p-tp 0", {}, "--p-tp must be an integer from 1 to 64"),
    ("soak --lease inf", {}, "--lease inf: expected a finite number"),
    ("soak --transport os:path", {}, "not a transport factory"),
    ("pairs --seconds nan", {}, "--seconds must be positive and at most a week"),
    ("pairs --seconds 0", {}, "--seconds must be positive and at most a week"),
    ("pairs --report-every 0", {}, "--report-every must be positive"),
    ("pairs --seed -1", {}, "--seed must be >= 0"),
    ("pairs --tp 3", {}, "--tp sizes must be 1, 2, 4 or 8, got 3"),
    ("pairs --tp", {}, "expected at least one argument"),
    # sim
    ("sim --requests 0", {}, "--requests must be between 1 and"),
    ("sim --requests 99999999999", {}, "--requests must be between 1 and"),
    ("sim --requests many", {}, "argument --requests: invalid int value"),
    ("sim --seed -1", {}, "--seed must be >= 0"),
    ("sim --faults nope", {}, "nope"),
    ("sim --faults drop,preempt", {}, "--faults preempt act on streamed prompts: add --stream"),
    # bench
    ("bench fleet --fleet 3", {}, "--fleet '3': expected PxDxTP"),
    ("bench fleet --fleet 1x1x3", {}, "TP 1/2/4/8"),
    ("bench fleet --store redis://h:1", {}, "--store 'redis://h:1': expected etcd://host:port"),
    ("bench wire --store etcd://h:1", {}, "--fleet and --store are options of the fleet suite"),
    ("bench nope", {}, "unknown bench suite 'nope'"),
    ("bench transport --transport nope", {}, "no transport named 'nope'"),
    ("bench transport --transport os:path", {}, "not a transport factory"),
    ("bench layout --plot {missing}", {}, "the layout suite has no sweeps to chart"),
    # probe
    ("probe 127.0.0.1:1", {}, "connection refused by tcp://127.0.0.1:1"),
    ("probe no-such-host.invalid:5600", {}, "cannot resolve host 'no-such-host.invalid'"),
    ("probe 127.0.0.1:0", {}, "port 0 is outside 1-65535"),
    ("probe 127.0.0.1", {}, "expected HOST:PORT, got '127.0.0.1'"),
    ("probe 127.0.0.1:http", {}, "port in '127.0.0.1:http' is not a number"),
    ("probe 127.0.0.1:1 --timeout nan", {}, "--timeout nan: expected a finite number"),
    ("probe 127.0.0.1:1 --timeout -1", {}, "--timeout -1.0: expected a number of seconds"),
    ("probe 127.0.0.1:1 --retries -1", {}, "--retries -1: expected an integer from 0"),
    ("probe 127.0.0.1:1 --retries 1e9", {}, "argument --retries: invalid int value"),
    ("probe 127.0.0.1:1 --tp-rank -1", {}, "--pp-rank and --tp-rank must be from 0"),
    ("probe 127.0.0.1:1 --version 12", {}, "12"),
    (
        "probe 127.0.0.1:1 --factors {model5}",
        {},
        "model5.json: invalid settings: missing 6 required",
    ),
    ("probe 127.0.0.1:1 --factors {missing}", {}, "cannot read"),
    ("probe 127.0.0.1:1 --secret-file {missing}", {}, "missing.json"),
    ("probe 127.0.0.1:1", {"KVWIRE_HANDSHAKE_RETRIES": "-3"}, "KVWIRE_HANDSHAKE_RETRIES='-3'"),
    # decode
    ("decode {empty}", {}, "is empty: no message to decode"),
    ("decode {missing}", {}, "cannot read"),
    ("decode {garbage}", {}, "not a message kvwire recognises"),
    ("decode {good} --version 99", {}, "99"),
    ("decode {good} --kind nope", {}, "argument --kind: invalid choice"),
    # compat-hash
    ("compat-hash {model5}", {}, "invalid settings: missing 6 required"),
    ("compat-hash {notjson}", {}, "invalid JSON"),
    ("compat-hash {list}", {}, "expected a JSON object"),
    ("compat-hash {missing}", {}, "cannot read"),
    ("compat-hash {good} --against {model5}", {}, "model5.json: invalid settings"),
    # conformance
    ("conformance nope", {}, "no transport named 'nope'"),
    ("conformance os:path", {}, "not a transport factory"),
    ("conformance json:dumps", {}, "not a transport"),
    ("conformance shm -o novalue", {}, "-o wants KEY=VALUE"),
    ("conformance shm -o bogus=1", {}, "unknown option(s) bogus"),
    ("conformance shm --accept-unchecked=yes", {}, "--accept-unchecked: ignored explicit argument"),
    # fleet
    ("fleet", {}, "no metadata store: pass --store etcd://host:port"),
    ("fleet --store http://h:1", {}, "--store 'http://h:1': expected etcd://host:port"),
    ("fleet --store etcd://127.0.0.1:1", {}, "etcd at etcd://127.0.0.1:1 unreachable"),
    ("fleet --store etcd://127.0.0.1:1 --updates 2", {}, "--updates takes a count >= 1"),
    ("fleet", {"KVWIRE_METADATA_STORE": "etcd://h:x"}, "KVWIRE_METADATA_STORE='etcd://h:x'"),
    # the global options and the configuration file
    ("--log-level loud sim", {}, "argument --log-level: invalid choice: 'LOUD'"),
    ("--config {missing} sim", {}, "cannot read config file"),
    ("--config {config_bad} sim", {}, "lease_s=-1: expected"),
    ("--config {config_typo} sim", {}, "unknown setting 'leas_s' (did you mean lease_s?)"),
    ("sim", {"KVWIRE_CONFIG": "{missing}"}, "cannot read config file"),
    ("nope", {}, "argument COMMAND: invalid choice: 'nope'"),
]


def test_every_subcommand_is_in_the_table() -> None:
    tried = {argv.split()[0] for argv, _, _ in TABLE}
    assert set(COMMANDS) <= tried


@pytest.mark.parametrize(("argv", "env", "cause"), TABLE, ids=[" ".join(r[:1]) for r in TABLE])
def test_bad_input_is_one_line_and_exit_2(
    argv: str,
    env: dict[str, str],
    cause: str,
    files: dict[str, str],
    taken_port: int,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in [k for k in os.environ if k.startswith("KVWIRE_")]:
        monkeypatch.delenv(key)
    names = {**files, "taken": str(taken_port)}
    for key, value in env.items():
        monkeypatch.setenv(key, value.format(**names))
    args = argv.format(**names).split()
    try:
        code = cli_main(args)
    except SystemExit as exit_:  # argparse's own errors
        code = int(exit_.code or 0)
    out, err = capfd.readouterr()
    lines = err.splitlines()
    assert code == 2, f"exit {code}; stderr:\n{err}"
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{err}"
    assert "Traceback" not in err + out
    assert cause in lines[0], f"{lines[0]!r} does not name the cause {cause!r}"


def test_a_refused_peer_is_reported_at_once(capfd: pytest.CaptureFixture[str]) -> None:
    """No waiting on the handshake timeout: with 30 s per attempt and 5 retries, a closed
    port still fails on the first refusal (the < 1 s wall time is shown in the report)."""
    t0 = time.monotonic()
    code = cli_main(["probe", "127.0.0.1:1", "--timeout", "30", "--retries", "5"])
    elapsed = time.monotonic() - t0
    err = capfd.readouterr().err
    assert code == 2
    assert err == "kvwire probe: connection refused by tcp://127.0.0.1:1 (nothing listens there)\n"
    assert elapsed < 30, elapsed


def test_version_and_help_show_defaults(capfd: pytest.CaptureFixture[str]) -> None:
    from kvwire import __version__

    with pytest.raises(SystemExit) as info:
        cli_main(["--version"])
    assert info.value.code == 0
    assert capfd.readouterr().out == f"kvwire {__version__}\n"
    with pytest.raises(SystemExit):
        cli_main(["sim", "--help"])
    text = " ".join(capfd.readouterr().out.split())
    assert "(default 2000)" in text and "(default all)" in text
    with pytest.raises(SystemExit):
        cli_main(["demo", "--help"])
    text = " ".join(capfd.readouterr().out.split())
    assert "(default: $KVWIRE_TRANSPORT, else shm)" in text and "(default: 64)" in text


def test_probe_and_compat_hash_agree_on_a_factors_file(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The file whose compat-hash equals the peer's hash is compatible in probe too; one
    that differs names only the factor that differs."""
    import numpy as np

    from kvwire.config import KVWireConfig
    from kvwire.layout.geometry import BlockRegion, KVGeometry
    from kvwire.runtime import Producer
    from kvwire.wire.compat import CompatFactors

    same, other = tmp_path / "same.json", tmp_path / "other.json"
    same.write_text(json.dumps(FACTORS))
    other.write_text(json.dumps({**FACTORS, "dtype": "float16"}))
    memory = np.zeros(16 * 4096, dtype=np.uint8)
    geometry = KVGeometry(
        regions=[
            BlockRegion(
                base_addr=memory.ctypes.data, block_len=4096, num_blocks=16, mem_kind="DRAM"
            )
        ],
        kv_cache_layout="HND",
        block_size=16,
        total_kv_heads=8,
    )
    config = KVWireConfig(
        engine_id="p-probe", compat=CompatFactors.build(**FACTORS), environ={}, transport="shm"
    )
    with Producer(config) as producer:
        producer.register_kv_caches(geometry)
        host, port = producer.side_channel
        assert cli_main(["compat-hash", str(same)]) == 0
        file_hash = capfd.readouterr().out.strip()
        assert cli_main(["probe", f"{host}:{port}", "--factors", str(same), "--json"]) == 0
        report = json.loads(capfd.readouterr().out)
        assert report["compatibility_hash"] == file_hash
        assert report["compatibility"]["compatible"] is True
        assert cli_main(["probe", f"{host}:{port}", "--factors", str(other)]) == 1
        text = capfd.readouterr().out
        assert "INCOMPATIBLE" in text
        assert "    dtype: ours 'torch.float16', theirs 'torch.bfloat16'" in text
        assert "speculative_config" not in text
        assert cli_main(["compat-hash", str(other), "--against", str(same), "--json"]) == 1
        doc = json.loads(capfd.readouterr().out)
        assert doc["differing"] == {"dtype": ["torch.float16", "torch.bfloat16"]}
