"""Fetch a live engine's handshake (kvwire or vLLM), decode it and print its metadata.

With --factors FILE (the factors or settings file `kvwire compat-hash` reads, through the
same loader and comparison) it also says whether this engine would be compatible and which
factors differ: the tool for "hash mismatch" at 3 a.m. Exit status 1 when --factors shows
a mismatch. With --secret-file it speaks the authenticated handshake of an engine that
requires it. A refused connection or an unknown host is reported at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", metavar="HOST:PORT", help="the engine's side channel")
    parser.add_argument("--pp-rank", type=int, default=0, help="pipeline stage to ask for")
    parser.add_argument("--tp-rank", type=int, default=0, help="TP rank to ask for")
    parser.add_argument("--factors", metavar="FILE", help="local compatibility factors (JSON)")
    parser.add_argument(
        "--version",
        type=int,
        default=None,
        help="protocol version to decode with (default: the peer's, else 13)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        help="seconds per attempt (default: $KVWIRE_HANDSHAKE_TIMEOUT_S, else 5)",
    )
    parser.add_argument(
        "--retries", type=int, help="retries (default: $KVWIRE_HANDSHAKE_RETRIES, else 2)"
    )
    parser.add_argument(
        "--secret-file",
        metavar="PATH",
        help="shared secret of an engine that runs authenticated handshakes "
        "(default: $KVWIRE_SECRET_FILE)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    import msgspec

    from kvwire.commands import load_config
    from kvwire.commands.factors_file import Comparison, compare, load_factors
    from kvwire.errors import ConfigError, HandshakeError, IncompatiblePeerError, WireDecodeError
    from kvwire.sidechannel import HandshakeClient, parse_host_port
    from kvwire.wire.compat import CompatFactors, format_differences
    from kvwire.wire.handshake import decode_handshake, decode_handshake_payload, peer_version
    from kvwire.wire.versions import protocol

    host, port = parse_host_port(args.address)
    if not (0 <= args.pp_rank < 1024 and 0 <= args.tp_rank < 1024):
        raise ConfigError("--pp-rank and --tp-rank must be from 0 to 1023")
    if args.version is not None:
        protocol(args.version)  # refuse unknown versions before dialling
    local = load_factors(args.factors) if args.factors else None
    config = load_config(
        args,
        handshake_timeout_s=args.timeout,
        handshake_retries=args.retries,
        secret_file=args.secret_file,
    )
    with HandshakeClient(config.handshake, secret=config.secret) as client:
        replies = client.fetch_payloads(host, port, [(args.pp_rank, args.tp_rank)])
    reply = replies.replies[(args.pp_rank, args.tp_rank)]
    try:
        payload = decode_handshake_payload(reply.payload)
        version = args.version or peer_version(payload) or 13
        metadata = decode_handshake(reply.payload, local_hash=None, version=version)
    except WireDecodeError as exc:
        raise HandshakeError(f"{host}:{port} answered with an undecodable payload: {exc}") from exc
    report: dict[str, Any] = {
        "address": f"{host}:{port}",
        "rank": {"pp": args.pp_rank, "tp": args.tp_rank},
        "rtt_ms": reply.rtt * 1e3,
        "clock_offset_s": reply.offset,
        "compatibility_hash": payload.compatibility_hash,
        "peer": "kvwire" if payload.kvwire is not None else "vLLM (or kvwire without factors)",
        "authenticated": config.secret is not None,
        "peer_version": peer_version(payload),
        "decoded_as_version": version,
        "metadata": _metadata_dict(msgspec.to_builtins(metadata), len(metadata.agent_metadata)),
    }
    peer_factors = payload.kvwire.factors if payload.kvwire is not None else None
    if peer_factors is not None:
        report["peer_factors"] = peer_factors
    compatible = True
    if local is not None:
        result = compare(local, payload.compatibility_hash, peer_factors or None)
        if not result.compatible and not result.differing:
            try:  # a vLLM peer states no factors: guess which one it changed
                decode_handshake(
                    reply.payload, local_hash=result.local_hash, version=version,
                    local_factors=CompatFactors.from_dict(local.as_dict()),
                )  # fmt: skip
            except IncompatiblePeerError as exc:
                guessed = dict(getattr(exc, "differing", {}))
                if guessed:
                    how = "guessed: recomputed the peer's hash with these factors changed"
                    result = Comparison(result.local_hash, result.remote_hash, False, guessed, how)
        compatible = result.compatible
        report["compatibility"] = {
            **result.as_dict(),
            "summary": format_differences(result.differing) if result.differing else "",
        }
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(_text(report))
    return 0 if compatible else 1


def _metadata_dict(raw: Any, blob_len: int) -> dict[str, Any]:
    """Metadata as JSON-friendly values; the opaque transport blob shown by its size."""
    out: dict[str, Any] = dict(raw)
    out["agent_metadata"] = f"<{blob_len} bytes of transport metadata>"
    return out


def _text(report: dict[str, Any]) -> str:
    md = report["metadata"]
    lines = [
        f"{report['address']} rank pp={report['rank']['pp']} tp={report['rank']['tp']}: "
        f"{report['peer']}{' (authenticated)' if report['authenticated'] else ''}, "
        f"rtt {report['rtt_ms']:.2f} ms, clock offset "
        f"{report['clock_offset_s']:+.6f} s",
        f"  compatibility_hash  {report['compatibility_hash']}",
    ]
    if report.get("peer_version") is not None:
        lines.append(f"  protocol version    {report['peer_version']}")
    for key, value in md.items():
        lines.append(f"  {key:<38}{value}")
    compat = report.get("compatibility")
    if compat is not None:
        verdict = "compatible" if compat["compatible"] else "INCOMPATIBLE"
        lines.append(f"  with --factors: {verdict} (local hash {compat['local_hash']})")
        for name, (ours, theirs) in compat["differing"].items():
            lines.append(f"    {name}: ours {ours!r}, theirs {theirs!r}")
        if not compat["compatible"] and not compat["differing"]:
            lines.append(f"    differing factors: {compat['how']}")
    return "\n".join(lines) + "\n"
