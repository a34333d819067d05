"""Show the engines published in a metadata store (etcd): their ranks, versions and
compatibility groups.

Engines whose ranks run with ``metadata_store`` set publish their handshake payloads
under ``/kvwire/v1/engines/{hash}/{engine}/{pp}/{tp}``. This lists them grouped by
compatibility hash and, for every pair of groups, says which factors differ (kvwire peers
state their factors in the payload). With --watch it prints again on every change until
interrupted. Sealed records (engines with a secret) show their factors only with
--secret-file. The store defaults to $KVWIRE_METADATA_STORE.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Mapping
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        metavar="URL",
        help="etcd://host:port of the metadata store (default: $KVWIRE_METADATA_STORE)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (one line per snapshot)")
    parser.add_argument("--watch", action="store_true", help="print again on every change")
    parser.add_argument(
        "--updates",
        type=int,
        default=None,
        metavar="N",
        help="with --watch: stop after N snapshots (default: until interrupted)",
    )
    parser.add_argument(
        "--secret-file",
        metavar="PATH",
        help="secret to open sealed records (default: $KVWIRE_SECRET_FILE)",
    )


def run(args: argparse.Namespace) -> int:
    from kvwire.commands import load_config
    from kvwire.errors import ConfigError, MetadataStoreError
    from kvwire.sidechannel.etcd import EtcdClient
    from kvwire.sidechannel.store_records import ROOT

    if args.updates is not None and (args.updates < 1 or not args.watch):
        raise ConfigError("--updates takes a count >= 1, with --watch")
    config = load_config(args, metadata_store=args.store, secret_file=args.secret_file)
    if config.metadata_store is None:
        raise ConfigError("no metadata store: pass --store etcd://host:port")
    client = EtcdClient(config.metadata_store)
    shown = 0
    while True:
        revision, kvs = client.get_prefix(ROOT)
        report = fleet_report(
            config.metadata_store, revision, {kv.key: kv.value for kv in kvs}, config.secret
        )
        if args.json:
            sys.stdout.write(json.dumps(report, default=str) + "\n")
        else:
            sys.stdout.write(_text(report))
        sys.stdout.flush()
        shown += 1
        if not args.watch or (args.updates is not None and shown >= args.updates):
            return 0
        watch = client.watch(ROOT, revision + 1)
        try:
            while not watch.events(timeout=1.0):
                pass
        except MetadataStoreError as exc:
            sys.stderr.write(f"kvwire fleet: {exc}; listing again\n")
        finally:
            watch.close()


def fleet_report(
    url: str, revision: int, values: Mapping[bytes, bytes], secret: bytes | None
) -> dict[str, Any]:
    """Engines, groups and group-to-group differences from the store's raw records."""
    from kvwire.errors import KVWireError
    from kvwire.sidechannel.store_records import decode_record, parse_key
    from kvwire.wire.handshake import decode_handshake_payload

    engines: dict[tuple[str, str], dict[str, Any]] = {}
    factors: dict[str, dict[str, Any]] = {}
    unreadable = 0
    for key, value in sorted(values.items()):
        parsed = parse_key(key)
        if parsed is None:
            unreadable += 1
            continue
        group, engine_id, (pp, tp) = parsed
        try:
            record = decode_record(key, value, secret)
        except KVWireError:
            try:  # a sealed record without the secret: the clear fields are still shown
                record = decode_record(key, value, None)
            except KVWireError:
                unreadable += 1
                continue
        rank: dict[str, Any] = {
            "pp": pp, "tp": tp, "host": record.host, "port": record.port,
            "role": record.role, "kvwire": record.kvwire_version,
            "protocol_version": None, "sealed": bool(record.seal),
        }  # fmt: skip
        if not record.seal:
            try:
                hello = decode_handshake_payload(record.payload).kvwire
            except KVWireError:
                hello = None
            if hello is not None:
                rank["protocol_version"] = hello.connector_version
                if hello.factors:
                    factors.setdefault(group, dict(hello.factors))
        entry = engines.setdefault(
            (group, engine_id), {"engine_id": engine_id, "group": group, "ranks": []}
        )
        entry["ranks"].append(rank)
    for entry in engines.values():
        ranks = entry["ranks"]
        entry["tp_size"] = 1 + max(r["tp"] for r in ranks)
        entry["pp_size"] = 1 + max(r["pp"] for r in ranks)
        entry["role"] = ",".join(sorted({r["role"] for r in ranks if r["role"]}))
        entry["kvwire"] = ",".join(sorted({r["kvwire"] for r in ranks}))
        versions = {r["protocol_version"] for r in ranks} - {None}
        entry["protocol_version"] = versions.pop() if len(versions) == 1 else None
    groups = sorted({g for g, _ in engines})
    return {
        "store": url,
        "revision": revision,
        "engines": [engines[k] for k in sorted(engines)],
        "groups": [
            {
                "hash": g,
                "engines": sorted(e for h, e in engines if h == g),
                "factors": factors.get(g),
            }
            for g in groups
        ],
        "incompatible": [_pair(a, b, factors) for a, b in itertools.combinations(groups, 2)],
        "unreadable_records": unreadable,
    }


def _pair(a: str, b: str, factors: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """Why two groups cannot talk: the differing factors, when both groups state theirs."""
    from kvwire.wire.compat import explain

    fa, fb = factors.get(a), factors.get(b)
    differing = explain(fa, fb) if fa is not None and fb is not None else None
    return {
        "groups": [a, b],
        "differing": {k: list(v) for k, v in differing.items()} if differing is not None else None,
    }


def _text(report: dict[str, Any]) -> str:
    lines = [
        f"{report['store']} (revision {report['revision']}): {len(report['engines'])} engines "
        f"in {len(report['groups'])} compatibility groups"
    ]
    for group in report["groups"]:
        lines.append(f"group {group['hash'][:16]}: {', '.join(group['engines'])}")
        for engine in (e for e in report["engines"] if e["group"] == group["hash"]):
            where = sorted({f"{r['host']}:{r['port']}" for r in engine["ranks"]})
            lines.append(
                f"  {engine['engine_id']}  {engine['role'] or '?'}  "
                f"tp={engine['tp_size']} pp={engine['pp_size']} "
                f"ranks={len(engine['ranks'])}  protocol v{engine['protocol_version'] or '?'}  "
                f"kvwire {engine['kvwire']}  {' '.join(where)}"
            )
    for pair in report["incompatible"]:
        a, b = (g[:16] for g in pair["groups"])
        why = pair["differing"]
        if why is None:
            text = "factors not stated (sealed or vLLM records)"
        else:
            text = "; ".join(f"{k}: {x!r} != {y!r}" for k, (x, y) in why.items()) or "same factors"
        lines.append(f"{a} x {b} cannot talk: {text}")
    if report["unreadable_records"]:
        lines.append(f"{report['unreadable_records']} unreadable records under the prefix")
    return "\n".join(lines) + "\n"
