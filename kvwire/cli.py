"""The ``kvwire`` command line: one subcommand per module in :mod:`kvwire.commands`.

Every command meets bad input the same way: one line on stderr naming the cause and exit
status 2, never a traceback, and before any process starts. Ctrl-C and SIGTERM end a
command with one line (exit 130 / 143) after its ``finally`` blocks have stopped the
processes it started. Command modules import their heavy dependencies inside ``run`` so
``kvwire --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from kvwire.errors import KVWireError

# name -> (module under kvwire.commands, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "run prefill and decode processes moving verified KV"),
    "bench": ("bench", "measure kvwire beside its baselines"),
    "sim": ("sim", "deterministic simulation of P/D engines with fault injection"),
    "soak": ("soak", "run P and D processes for a time with random rank kills"),
    "pairs": ("pairs", "random P/D pairs end to end for a time, every token checked"),
    "probe": ("probe", "fetch and decode a live engine's handshake"),
    "decode": ("decode", "decode a wire message and print it as JSON"),
    "compat-hash": ("compat_hash", "compute or compare compatibility hashes"),
    "conformance": ("conformance", "run the transport conformance suite"),
    "fleet": ("fleet", "list the engines a metadata store (etcd) holds, by compatibility"),
}

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors in one line and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: {message}\n")
        raise SystemExit(EXIT_USAGE)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Defaults shown in --help where a flag has a fixed one (a flag that defers to the
    configuration says so in its own help), descriptions as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default" in text
            or default is None
            or default is False
            or default == []
            or default == argparse.SUPPRESS
            or isinstance(action, argparse._CountAction)
        ):
            return text
        return f"{text} (default: %(default)s)"


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so ``finally`` blocks stop child processes."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise _Terminated()


def build_parser() -> argparse.ArgumentParser:
    from kvwire import __version__

    parser = _Parser(
        prog="kvwire",
        description="KV-cache transfer for disaggregated serving.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"kvwire {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log more (-v: INFO, -vv: DEBUG)",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        help="log level (default: $KVWIRE_LOG_LEVEL, else WARNING)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="configuration file, TOML or JSON (default: $KVWIRE_CONFIG)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(f"kvwire.commands.{module_name}")
        cmd = sub.add_parser(
            name, help=help_text, description=module.__doc__, formatter_class=_Formatter
        )
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def _setup_logging(args: argparse.Namespace) -> None:
    """The configured level on stderr; exported so the processes a command starts log the
    same way (they read ``KVWIRE_LOG_LEVEL`` through their own configuration)."""
    from kvwire.commands import load_config

    level = args.log_level or ("DEBUG" if args.verbose > 1 else "INFO" if args.verbose else None)
    config = load_config(args, log_level=level)
    os.environ["KVWIRE_LOG_LEVEL"] = config.log_level
    if args.config:
        os.environ["KVWIRE_CONFIG"] = os.path.abspath(args.config)
    logging.basicConfig(
        stream=sys.stderr,
        level=config.log_level,
        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    previous = signal.getsignal(signal.SIGTERM)
    in_main = _in_main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, _terminate)
    try:
        _setup_logging(args)
        code: int = args._run(args)
    except KVWireError as exc:
        sys.stderr.write(f"kvwire {args.command}: {_one_line(exc)}\n")
        return EXIT_USAGE
    except OSError as exc:
        sys.stderr.write(f"kvwire {args.command}: {_one_line(exc.strerror or exc)}\n")
        return EXIT_USAGE
    except _Terminated:
        sys.stderr.write(f"kvwire {args.command}: terminated\n")
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        sys.stderr.write(f"kvwire {args.command}: interrupted\n")
        return EXIT_INTERRUPTED
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    return code


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    raise SystemExit(main())
