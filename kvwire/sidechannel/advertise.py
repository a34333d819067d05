"""The address a peer can dial, for a listener that may be bound to every interface.

A producer puts its side channel's host and port in ``kv_transfer_params``; a wildcard
(``0.0.0.0``, ``::``) or port 0 there sends the decode side to dial itself. A wildcard bind
is advertised as the host's routable address: the source address of its default route, or
else its one non-loopback interface address. When neither settles it (no route and several
interfaces) the operator must name it, and the error says how.
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct

from kvwire.errors import ConfigError

WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
_SIOCGIFADDR = 0x8915
_ROUTE_PROBE = "198.51.100.1"
"""An off-link documentation address: connecting a UDP socket to it only asks the kernel
which source address the default route would use (no packet is sent)."""


def is_wildcard(host: str) -> bool:
    return host.strip() in WILDCARDS


def advertised_host(bind_host: str, advertise_host: str | None = None) -> str:
    """The host peers are told to dial for a listener bound to ``bind_host``."""
    if advertise_host:
        if is_wildcard(advertise_host):
            raise ConfigError(f"advertise_host {advertise_host!r} is a wildcard, not an address")
        return advertise_host
    if not is_wildcard(bind_host):
        return bind_host
    route = _default_route_source()
    if route is not None:
        return route
    candidates = interface_addresses()
    if len(candidates) == 1:
        return candidates[0]
    found = ", ".join(candidates) if candidates else "none"
    raise ConfigError(
        f"the side channel listens on {bind_host or '*'} (every interface) and no single "
        f"routable address was found (candidates: {found}); set advertise_host "
        "(KVWIRE_ADVERTISE_HOST, --advertise-host) to the address peers dial"
    )


def advertised_port(port: int) -> int:
    if not 0 < port < 65536:
        raise ConfigError(f"cannot advertise port {port}: the listener is not started")
    return port


def _default_route_source() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((_ROUTE_PROBE, 9))
            host = str(probe.getsockname()[0])
    except OSError:
        return None
    return None if ipaddress.ip_address(host).is_loopback or host == "0.0.0.0" else host


def interface_addresses() -> list[str]:
    """Non-loopback IPv4 addresses of this host's interfaces (Linux ioctl, no dependency)."""
    found: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = array.array("B", struct.pack("256s", name.encode()[:15]))
            try:
                fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request, True)
            except OSError:
                continue  # no IPv4 address on this interface
            host = socket.inet_ntoa(request.tobytes()[20:24])
            if not ipaddress.ip_address(host).is_loopback and host not in found:
                found.append(host)
    return found
