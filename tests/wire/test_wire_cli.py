"""``kvwire decode`` and ``kvwire compat-hash``: output, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvwire
from kvwire.cli import main

VECTORS = Path(__file__).resolve().parent.parent / "vectors"
V15 = json.loads((VECTORS / "vllm-0.33.0-nixl-v15.json").read_text())
V13 = json.loads((VECTORS / "vllm-0.31.0-nixl-v13.json").read_text())
PARAMS15 = V15["kv_transfer_params"][2]["kv_transfer_params"]
PARAMS15_MSGPACK = kvwire.encode(kvwire.parse_kv_transfer_params(PARAMS15, version=15))


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (bytes.fromhex(V15["handshake_payload"][0]["msgpack"]), "handshake-payload"),
        (bytes.fromhex(V13["agent_metadata"][1]["msgpack"]), "agent-metadata"),
        (bytes.fromhex(V13["handshake_request"][2]["msgpack"]), "handshake-request"),
        (bytes.fromhex(V13["handshake_clock"]["msgpack"]), "clock-reply"),
        (bytes.fromhex(V13["push_reg"][0]["notif"]), "push-reg"),
        (bytes.fromhex(V13["completion_notif"][1]["notif"]), "completion"),
        (bytes.fromhex(V13["heartbeat_notif"]["notif"]), "heartbeat"),
        (json.dumps(PARAMS15).encode(), "kv-transfer-params"),
        (PARAMS15_MSGPACK, "kv-transfer-params"),
    ],
)  # fmt: skip
def test_decode_recognises_every_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes, kind: str
) -> None:
    code, out, err = _run(["decode", _write(tmp_path, "msg", data)], capsys)
    assert (code, err) == (0, "")
    assert json.loads(out)["kind"] == kind
    # The same bytes given as hex text decode alike.
    code, out_hex, _ = _run(["decode", _write(tmp_path, "msg.hex", data.hex().encode())], capsys)
    assert code == 0 and json.loads(out_hex) == json.loads(out)


def test_decode_prints_fields_and_bytes_as_hex(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case = V13["agent_metadata"][2]
    code, out, _ = _run(["decode", _write(tmp_path, "m", bytes.fromhex(case["msgpack"]))], capsys)
    doc: dict[str, Any] = json.loads(out)
    assert code == 0 and doc["schema_version"] == 13
    expected = dict(case["fields"], agent_metadata=case["fields"]["agent_metadata"]["hex"])
    assert doc["message"] == expected


def test_decode_kind_and_version_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "p", bytes.fromhex(V15["handshake_payload"][1]["msgpack"]))
    code, out, _ = _run(["decode", "--kind", "handshake-payload", "--version", "15", path], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["schema_version"] == 15
    assert doc["message"]["compatibility_hash"] == V15["handshake_payload"][1]["compatibility_hash"]
    code, _, err = _run(["decode", "--kind", "heartbeat", path], capsys)
    assert code == 2 and err.count("\n") == 1


@pytest.mark.parametrize(
    "data",
    [b"garbage", b"\x91\x91\x91", b"\xff\xfe", b"", b"HB:a,,b", b"x:0", b"\x93\xc4\x03abc\x00\x00"],
)
def test_decode_bad_input_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes
) -> None:
    code, out, err = _run(["decode", _write(tmp_path, "bad", data)], capsys)
    assert code == 2 and out == ""
    assert err.startswith("kvwire decode: ") and err.count("\n") == 1


def test_decode_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = _run(["decode", str(tmp_path / "nope")], capsys)
    assert code == 2 and "nope" in err and err.count("\n") == 1


def test_decode_stdin_subprocess() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvwire", "decode", "-"],
        input=b"cmpl-9:4",
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    assert doc == {"kind": "completion", "message": {"request_id": "cmpl-9", "count": 4}}


def test_decode_bad_stdin_subprocess_has_no_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvwire", "decode", "-"],
        input=b"\x92\xc1",
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert b"Traceback" not in result.stderr and result.stderr.count(b"\n") == 1


def _json(tmp_path: Path, name: str, doc: object) -> str:
    return _write(tmp_path, name, json.dumps(doc).encode())


def test_compat_hash_of_factors_and_of_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for case in V13["compatibility_hash"] + V15["compatibility_hash"]:
        code, out, _ = _run(["compat-hash", _json(tmp_path, "f.json", case["factors"])], capsys)
        assert (code, out) == (0, case["hash"] + "\n")
        settings = dict(case["inputs"], connector_version=case["factors"]["nixl_connector_version"])
        code, out, _ = _run(["compat-hash", _json(tmp_path, "s.json", settings)], capsys)
        assert (code, out) == (0, case["hash"] + "\n")


def test_compat_hash_against(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = V13["compatibility_hash"][1]["factors"]
    b = dict(a, model="other", transfer_mode="push")
    path_a, path_b = _json(tmp_path, "a.json", a), _json(tmp_path, "b.json", b)
    code, out, _ = _run(["compat-hash", path_a, "--against", path_a], capsys)
    assert (code, out) == (0, f"compatible {V13['compatibility_hash'][1]['hash']}\n")
    code, out, _ = _run(["compat-hash", path_a, "--against", path_b], capsys)
    assert code == 1
    assert out.splitlines() == [
        f'model: "{a["model"]}" != "other"',
        'transfer_mode: "pull" != "push"',
    ]


@pytest.mark.parametrize(
    "content",
    [b"[", b"[1]", b'{"model": 1}', b'{"nixl_connector_version": 13}', b"\xff", b'{"dtype": 1}'],
)
def test_compat_hash_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    code, out, err = _run(["compat-hash", _write(tmp_path, "bad.json", content)], capsys)
    assert code == 2 and out == ""
    assert err.startswith("kvwire compat-hash: ") and err.count("\n") == 1
