"""kvwire: the KV-cache transfer protocol of disaggregated LLM serving, as a library.

Speaks vLLM's NIXL connector protocol (versions 13-15) byte for byte; transports are
pluggable adapters found through the ``kvwire.transports`` entry-point group.
"""

from __future__ import annotations

from kvwire.errors import (
    ConfigError,
    DescriptorError,
    HandshakeError,
    HandshakeTimeoutError,
    IncompatiblePeerError,
    KVWireError,
    LocalProtocolError,
    ProtocolError,
    RegistrationError,
    RemoteProtocolError,
    TransferFailedError,
    TransportClosedError,
    TransportError,
    TransportUnavailableError,
    UnknownPeerError,
    WireDecodeError,
    WireEncodeError,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DescriptorError",
    "HandshakeError",
    "HandshakeTimeoutError",
    "IncompatiblePeerError",
    "KVWireError",
    "LocalProtocolError",
    "ProtocolError",
    "RegistrationError",
    "RemoteProtocolError",
    "TransferFailedError",
    "TransportClosedError",
    "TransportError",
    "TransportUnavailableError",
    "UnknownPeerError",
    "WireDecodeError",
    "WireEncodeError",
    "__version__",
]
