"""Compute a compatibility hash, or compare two engines' factors.

FACTORS.json holds either the factors exactly as vLLM hashes them (it has
"nixl_connector_version"), or engine settings for the builder: vllm_version, model, dtype,
num_kv_heads, head_size, num_hidden_layers, attn_backend_name, cache_dtype, is_hma_enabled,
transfer_mode, speculative (an object or null) and connector_version (default 13). An object
with a "factors" key (as in the golden vectors) is read through that key.

Prints the hash. With --against OTHER.json prints "compatible <hash>" and exits 0 when both
hash alike, or one "factor: ours != theirs" line per differing factor and exits 1. --json
prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_DIFFERENT = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factors", metavar="FACTORS.json", help="factors or settings ('-': stdin)")
    parser.add_argument("--against", metavar="OTHER.json", help="compare with these factors")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from kvwire.commands.factors_file import compare, load_factors

    local = load_factors(args.factors)
    if args.against is None:
        if args.json:
            doc = {"hash": local.hash(), "factors": local.as_dict()}
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        else:
            sys.stdout.write(local.hash() + "\n")
        return 0
    remote = load_factors(args.against)
    result = compare(local, remote.hash(), remote)
    if args.json:
        sys.stdout.write(json.dumps(result.as_dict(), indent=2) + "\n")
    elif result.compatible:
        sys.stdout.write(f"compatible {result.local_hash}\n")
    else:
        for name, (ours, theirs) in result.differing.items():
            sys.stdout.write(f"{name}: {json.dumps(ours)} != {json.dumps(theirs)}\n")
    return 0 if result.compatible else EXIT_DIFFERENT
