"""The one exception hierarchy of kvwire.

Every failure kvwire reports derives from :class:`KVWireError`, so an engine can catch the
library's errors without catching its own. The subclasses split along who is at fault:
bytes from a peer that do not decode, a peer that speaks another protocol, a protocol rule
broken by us or by the peer, and the data plane failing underneath.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class KVWireError(Exception):
    """Root of every error kvwire raises."""


class WireDecodeError(KVWireError, ValueError):
    """Bytes that are not a valid message of the expected kind.

    Raised for truncated, oversize, mistyped or otherwise malformed input; never a raw
    msgspec exception, so callers need to handle exactly one type per decoder.
    """


class WireEncodeError(KVWireError, ValueError):
    """A message that cannot be put on the wire (for example a ',' in a heartbeat id)."""


class IncompatiblePeerError(KVWireError):
    """The peer speaks a different protocol version, hash or KV geometry.

    Carries both compatibility hashes and, when the peer told us its factors (kvwire peers
    do), the names of the factors that differ, so the message says *why* two engines will
    not talk instead of only *that* they will not.
    """

    def __init__(
        self,
        message: str,
        *,
        local_hash: str | None = None,
        remote_hash: str | None = None,
        differing: Mapping[str, tuple[Any, Any]] | None = None,
        local_version: int | None = None,
        remote_version: int | None = None,
    ) -> None:
        super().__init__(message)
        self.local_hash = local_hash
        self.remote_hash = remote_hash
        self.differing: dict[str, tuple[Any, Any]] = dict(differing or {})
        self.local_version = local_version
        self.remote_version = remote_version


class ProtocolError(KVWireError):
    """A rule of the transfer protocol was broken."""


class LocalProtocolError(ProtocolError):
    """Our own caller broke a rule: an event the current state does not accept."""


class RemoteProtocolError(ProtocolError):
    """The peer broke a rule: a message that makes no sense in the current state.

    Fails only the requests it concerns; the connection and other requests carry on.
    """


class HandshakeError(KVWireError):
    """The side-channel handshake with a peer did not complete."""


class HandshakeTimeoutError(HandshakeError, TimeoutError):
    """The peer did not answer the handshake in time."""


class PeerUnreachableError(HandshakeError):
    """No connection to the peer's side channel: its name does not resolve, or its host
    refused the connection (nothing listens on that port). Reported at once, not after
    the handshake timeout."""


class HandshakeAuthError(HandshakeError):
    """The authenticated handshake failed: no secret, a different secret, a peer that does
    not authenticate, or an answer that is forged or replayed. No metadata was used."""


class MetadataStoreError(KVWireError):
    """The metadata store (etcd) could not be reached, or answered something unusable.

    Never fails a request: the runtime falls back to the ZMQ handshake when it sees one."""


class ConfigError(KVWireError, ValueError):
    """A configuration value or a command-line argument is invalid."""


class TransportError(KVWireError):
    """A transport (data plane) operation failed.

    Adapters raise subclasses of this and never a backend's own exception; ``status`` keeps
    the backend's status name (NIXL's ``NIXL_ERR_...``, UCX's ``UCS_ERR_...``) when known.
    """

    def __init__(self, message: str, *, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


class TransportUnavailableError(TransportError):
    """The transport cannot be loaded here (a missing extra, library or device)."""


class TransportClosedError(TransportError):
    """The transport was used after ``close()``."""


class RegistrationError(TransportError):
    """Memory could not be registered or deregistered."""


class UnknownPeerError(TransportError):
    """An operation named a peer that was never added, or was removed."""


class DescriptorError(TransportError):
    """Descriptors that cannot be transferred: outside registered memory, mismatched lengths."""


class UnpreparedTablesError(DescriptorError):
    """Rows named by index in tables the transport does not hold for that peer: never
    prepared, or dropped since (the peer was added again or removed, or a local
    registration changed). Post the rows themselves, or prepare again."""


class TransferFailedError(TransportError):
    """A posted transfer failed (peer died, link cut, backend error)."""


class PeerMetadataError(TransportError):
    """A peer's transport metadata blob is not one this transport can use."""
