"""Run a prefill engine and a decode engine as separate processes and move verified KV.

Each engine has one process per TP rank with a KV cache of a real model's geometry (scaled
by --layers). P fills its blocks with content derived from the request and token position;
D receives them through the full protocol (handshake, READ or WRITE, notifications) and
checks every byte. Exit status 1 if any byte is wrong or any request failed.

--role prefill --listen HOST:PORT and --role decode --connect HOST:PORT run one side each
(for two hosts, with a transport that crosses hosts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

from kvwire.commands import load_config
from kvwire.errors import ConfigError

if TYPE_CHECKING:
    from kvwire.config import KVWireConfig
    from kvwire.demo.run import DemoOptions
    from kvwire.demo.soak import SoakSummary
    from kvwire.demo.summary import Summary


def add_workload_arguments(
    parser: argparse.ArgumentParser,
    *,
    layers: int = 8,
    tokens: int = 1024,
    tp: int | None = None,
    lease: float | None = None,
) -> None:
    """The P/D workload options ``kvwire demo`` and ``kvwire soak`` share (their defaults).

    With ``tp`` None, --p-tp and --d-tp stay None unless given: the byte demo then runs
    :class:`~kvwire.demo.run.DemoOptions`' TP 1, and ``--engine`` its own defaults.
    --mode, --transport and (with ``lease`` None) --lease come from the configuration
    when not given: ``KVWIRE_MODE``, ``KVWIRE_TRANSPORT``, ``KVWIRE_LEASE_S``, the file.
    """
    parser.add_argument(
        "--model", default="llama-3-8b", help="llama-3-8b, llama-3-70b or deepseek-v3 (alias: mla)"
    )
    parser.add_argument(
        "--layers", type=int, default=layers, help="layers of the model to allocate (scales memory)"
    )
    parser.add_argument("--tokens", type=int, default=tokens, help="prompt tokens per request")
    parser.add_argument(
        "--concurrency", type=int, default=8, help="requests in flight on the decode engine"
    )
    parser.add_argument(
        "--mode", choices=("pull", "push"), help="transfer mode (default: $KVWIRE_MODE, else pull)"
    )
    parser.add_argument(
        "--transport",
        help="shm, nixl, ucx or module:factory (default: $KVWIRE_TRANSPORT, else shm)",
    )
    parser.add_argument("--p-tp", type=int, default=tp, help="prefill TP size (processes)")
    parser.add_argument("--d-tp", type=int, default=tp, help="decode TP size (processes)")
    lease_help = "producer lease in seconds" + (
        "" if lease is not None else " (default: $KVWIRE_LEASE_S, else 30)"
    )
    parser.add_argument("--lease", type=float, default=lease, help=lease_help)


def workload_config(args: argparse.Namespace) -> KVWireConfig:
    """The configuration the workload flags are the explicit layer of."""
    return load_config(
        args,
        mode=args.mode,
        transport=args.transport,
        lease_s=args.lease,
        secret_file=getattr(args, "secret_file", None),
    )


def workload_options(args: argparse.Namespace, **extra: Any) -> DemoOptions:
    """DemoOptions from the shared workload arguments and the configuration, plus the
    caller's own fields; validated."""
    from kvwire.demo.run import DemoOptions

    config = workload_config(args)
    if not isinstance(config.transport, str):  # pragma: no cover - a file cannot hold one
        raise ConfigError("the demo's transport must be a name")
    tp = {k: v for k, v in (("p_tp", args.p_tp), ("d_tp", args.d_tp)) if v is not None}
    options = DemoOptions(
        model=args.model,
        layers=args.layers,
        tokens=args.tokens,
        concurrency=args.concurrency,
        mode=config.mode,
        transport=config.transport,
        lease_s=config.lease_s,
        secret=config.secret,
        **tp,
        **extra,
    )
    options.validate()
    return options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument("--requests", type=int, default=64, help="requests to move")
    parser.add_argument("--role", choices=("both", "prefill", "decode"), default="both")
    parser.add_argument("--listen", metavar="HOST:PORT", help="--role prefill: control address")
    parser.add_argument("--connect", metavar="HOST:PORT", help="--role decode: the prefill side")
    parser.add_argument(
        "--advertise-host",
        metavar="HOST",
        help="--role prefill: the address D dials for the side channel (default: "
        "$KVWIRE_ADVERTISE_HOST, else the --listen host, or for 0.0.0.0 this host's "
        "routable address)",
    )
    parser.add_argument(
        "--secret-file",
        metavar="PATH",
        help="shared secret: authenticated handshakes (give it to both roles; chmod 600)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    _add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.engine:
        if args.secret_file:
            raise ConfigError("--secret-file is not supported with --engine")
        return _run_engine_demo(args)
    from kvwire.demo.run import log, run_local

    if args.role == "both" and (args.listen or args.connect):
        raise ConfigError("--listen and --connect go with --role prefill / --role decode")
    if args.role == "prefill" and not args.listen:
        raise ConfigError("--role prefill needs --listen HOST:PORT")
    if args.role == "decode" and not args.connect:
        raise ConfigError("--role decode needs --connect HOST:PORT")
    options = workload_options(args, requests=args.requests, progress=not args.no_progress)
    check_transport(options.transport)
    if args.role == "prefill":
        return _run_prefill(options, args.listen, args.advertise_host)
    if args.role == "decode":
        summary = _run_decode(options, args.connect)
    else:
        log(
            f"kvwire demo: starting P (TP={options.p_tp}) and D (TP={options.d_tp}) processes, "
            f"{options.mode} over {options.transport}"
        )
        summary = run_local(options)
    write_summary(summary, as_json=args.json)
    return 0 if summary.verified else 1


def write_summary(summary: Summary | SoakSummary, *, as_json: bool) -> None:
    """The summary on stdout, as JSON or as its table (``kvwire demo`` and ``kvwire soak``)."""
    if as_json:
        sys.stdout.write(json.dumps(summary.as_dict(), indent=2) + "\n")
    else:
        sys.stdout.write(summary.table())


def check_transport(name: str) -> None:
    """Load the transport here, so a missing one is a usage error, not a crash in a child;
    a ``module:factory`` also starts (and closes) one agent, since only that shows it is a
    transport factory at all."""
    import os

    from kvwire.transport import create, load

    load(name)
    if ":" in name:
        try:
            agent = create(name, f"kvwire-check-{os.getpid()}")
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"transport {name!r} cannot start an agent: {exc}") from None
        agent.close()


def _run_prefill(options: DemoOptions, listen: str, advertise_host: str | None) -> int:
    from kvwire.demo import control
    from kvwire.demo.engines import PrefillEngine
    from kvwire.demo.run import log
    from kvwire.sidechannel import parse_host_port
    from kvwire.sidechannel.advertise import advertised_host

    host, port = parse_host_port(listen)
    reach = advertised_host(host, advertise_host)  # fail now, not in a rank process
    server = control.bind(host, port)  # a taken port fails here, before any process starts
    try:
        engine_options = options.engine("prefill", options.p_tp, host=host)
        engine_options = dataclasses.replace(engine_options, advertise_host=reach)
        engine = PrefillEngine(engine_options).start()
        try:
            log(
                f"kvwire demo: prefill engine {engine_options.engine_id} ({options.p_tp} ranks) "
                f"listening on {host}:{port}, side channel {reach}:{engine.side_channel_port}"
            )
            control.serve(engine, server)
        finally:
            engine.close()
    finally:
        server.close()
    return 0


def _run_decode(options: DemoOptions, connect: str | None) -> Summary:
    import dataclasses

    from kvwire.demo import control
    from kvwire.demo.engines import DecodeEngine
    from kvwire.demo.run import drive, log
    from kvwire.sidechannel import parse_host_port

    if not connect:
        raise ConfigError("--role decode needs --connect HOST:PORT")
    host, port = parse_host_port(connect)
    client = control.PrefillClient(host, port)
    try:
        hello = client.hello()
        if bool(hello.get("authenticated")) != (options.secret is not None):
            need = "needs" if hello.get("authenticated") else "runs without"
            raise ConfigError(f"the prefill side {need} --secret-file; give both roles the same")
        options = dataclasses.replace(
            options, model=hello["model"], layers=int(hello["layers"]), p_tp=int(hello["tp"]),
            mode=hello["mode"], transport=hello["transport"],
        )  # fmt: skip
        options.validate()
        log(f"kvwire demo: decoding for {hello['engine_id']} at {host}:{port} "
            f"({options.model}, {options.mode} over {options.transport})")  # fmt: skip
        decode = DecodeEngine(options.engine("decode", options.d_tp)).start()
        try:
            summary = drive(options, client, decode)
        finally:
            decode.close()
        client.bye()
        return summary
    finally:
        client.close()


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """``--engine``: the reference engine's P/D token-identity demo (kvwire.examples.engine).

    It shares --mode, --transport, --p-tp, --d-tp and --json with the byte demo.
    """
    group = parser.add_argument_group("--engine (reference transformer, greedy tokens compared)")
    group.add_argument("--engine", action="store_true", help="run the reference-engine demo")
    group.add_argument("--prompts", type=int, default=6, help="prompts to serve")
    group.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    group.add_argument("--p-layout", choices=("HND", "NHD"), default="HND")
    group.add_argument("--d-layout", choices=("HND", "NHD"), default="NHD")
    group.add_argument("--mla", action="store_true", help="MLA: one latent cache per rank")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--seed", type=int, default=0, help="model weights and prompts")
    group.add_argument(
        "--rank-processes",
        action="store_true",
        help="one process per TP rank (default: per engine)",
    )


def _run_engine_demo(args: argparse.Namespace) -> int:
    """The engine needs torch, so it is imported only here."""
    config = workload_config(args)  # --mode / --transport, else KVWIRE_MODE / _TRANSPORT
    args.mode, args.transport = config.mode, config.transport
    for flag, value, low, high in (
        ("--prompts", args.prompts, 1, 10_000),
        ("--max-tokens", args.max_tokens, 1, 4096),
        ("--block-size", args.block_size, 1, 1024),
        ("--seed", args.seed, 0, 2**32 - 1),
        ("--p-tp", args.p_tp if args.p_tp is not None else 1, 1, 64),
        ("--d-tp", args.d_tp if args.d_tp is not None else 1, 1, 64),
    ):
        if not low <= value <= high:
            raise ConfigError(f"{flag} must be an integer from {low} to {high}, got {value}")
    check_transport(str(config.transport))
    try:
        from kvwire.examples.engine import demo
    except ImportError as exc:
        raise ConfigError(f"kvwire demo --engine needs torch: {exc}") from exc
    return demo.run(args)
