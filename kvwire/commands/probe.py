"""Fetch a live engine's handshake (kvwire or vLLM), decode it and print its metadata.

With --factors FILE (a JSON object of compatibility factors, as `kvwire compat-hash`
takes) it also says whether this engine would be compatible and which factors differ:
the tool for "hash mismatch" at 3 a.m. Exit status 1 when --factors shows a mismatch.
With --secret-file it speaks the authenticated handshake of an engine that requires it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", metavar="HOST:PORT", help="the engine's side channel")
    parser.add_argument("--pp-rank", type=int, default=0)
    parser.add_argument("--tp-rank", type=int, default=0)
    parser.add_argument("--factors", metavar="FILE", help="local compatibility factors (JSON)")
    parser.add_argument(
        "--version",
        type=int,
        default=None,
        help="protocol version to decode with (default: the peer's, else 13)",
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per attempt")
    parser.add_argument("--retries", type=int, default=1)
    parser.add_argument(
        "--secret-file",
        metavar="PATH",
        help="shared secret of an engine that runs authenticated handshakes",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import msgspec

    from kvwire.compat import CompatFactors, compatibility_hash, explain, format_differences
    from kvwire.errors import ConfigError, HandshakeError, IncompatiblePeerError, WireDecodeError
    from kvwire.sidechannel import HandshakeClient, RetryPolicy, load_secret, parse_host_port
    from kvwire.wire.handshake import decode_handshake, decode_handshake_payload, peer_version

    host, port = parse_host_port(args.address)
    if args.pp_rank < 0 or args.tp_rank < 0:
        raise ConfigError("--pp-rank and --tp-rank must be >= 0")
    local: dict[str, Any] | None = None
    if args.factors:
        try:
            local = json.loads(Path(args.factors).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read factors from {args.factors}: {exc}") from None
        if not isinstance(local, dict):
            raise ConfigError(f"{args.factors} does not hold a JSON object of factors")
    secret = load_secret(args.secret_file) if args.secret_file else None
    policy = RetryPolicy(timeout=args.timeout, retries=args.retries)
    with HandshakeClient(policy, secret=secret) as client:
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
        "authenticated": secret is not None,
        "peer_version": peer_version(payload),
        "decoded_as_version": version,
        "metadata": _metadata_dict(msgspec.to_builtins(metadata), len(metadata.agent_metadata)),
    }
    if payload.kvwire is not None and payload.kvwire.factors is not None:
        report["peer_factors"] = payload.kvwire.factors
    compatible = True
    if local is not None:
        local_hash = compatibility_hash(local)
        compatible = local_hash == payload.compatibility_hash
        differing: dict[str, Any] = {}
        how = "equal hashes" if compatible else "unknown (peer did not state its factors)"
        if not compatible and payload.kvwire is not None and payload.kvwire.factors:
            differing = explain(local, payload.kvwire.factors)
            how = "from the factors the peer states"
        elif not compatible:
            try:
                decode_handshake(
                    reply.payload, local_hash=local_hash, version=version,
                    local_factors=CompatFactors.from_dict(local),
                )  # fmt: skip
            except IncompatiblePeerError as exc:
                differing = dict(getattr(exc, "differing", {}))
                if differing:
                    how = "guessed: recomputed the peer's hash with these factors changed"
            except ConfigError:
                pass
        report["compatibility"] = {
            "local_hash": local_hash,
            "compatible": compatible,
            "differing": {k: [a, b] for k, (a, b) in differing.items()},
            "how": how,
            "summary": format_differences(differing) if differing else "",
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
