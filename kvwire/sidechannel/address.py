"""Host/port helpers shared by the listener, the client and the CLI."""

from __future__ import annotations

from kvwire.errors import ConfigError


def tcp_endpoint(host: str, port: int) -> str:
    """The ZMQ endpoint of ``host:port``; IPv6 literals get brackets."""
    bare = host.strip("[]")
    if is_ipv6(bare):
        return f"tcp://[{bare}]:{port}"
    return f"tcp://{bare}:{port}"


def is_ipv6(host: str) -> bool:
    return ":" in host.strip("[]")


def parse_host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` to a pair; a ``ConfigError`` names what is wrong."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"expected HOST:PORT, got {text!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"port in {text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ConfigError(f"port {port} is outside 1-65535")
    return host.strip("[]"), port
