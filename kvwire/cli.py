"""The ``kvwire`` command line: one subcommand per module in :mod:`kvwire.commands`.

Every command meets bad input the same way: one line on stderr naming the cause and exit
status 2, never a traceback. Command modules import their heavy dependencies inside
``run`` so ``kvwire --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvwire.errors import KVWireError

# name -> (module under kvwire.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "run prefill and decode processes moving verified KV"),
    "bench": ("bench", "measure kvwire beside its baselines"),
    "sim": ("sim", "deterministic simulation of P/D engines with fault injection"),
    "soak": ("soak", "run P and D processes for a time with random rank kills"),
    "probe": ("probe", "fetch and decode a live engine's handshake"),
    "decode": ("decode", "decode a wire message and print it as JSON"),
    "compat-hash": ("compat_hash", "compute or compare compatibility hashes"),
    "conformance": ("conformance", "run the transport conformance suite"),
}

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors in one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"kvwire: {message}\n")
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvwire", description="KV-cache transfer for disaggregated serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(f"kvwire.commands.{module_name}")
        cmd = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args._run(args)
    except KVWireError as exc:
        sys.stderr.write(f"kvwire {args.command}: {exc}\n")
        return EXIT_USAGE
    except OSError as exc:
        sys.stderr.write(f"kvwire {args.command}: {exc.strerror or exc}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write(f"kvwire {args.command}: interrupted\n")
        return 130
    return code


if __name__ == "__main__":
    raise SystemExit(main())
