"""The authenticated handshake (kvwire extension, opt-in): shared secret, challenge-response.

Plain mode is vLLM's handshake, byte for byte. With a secret, one rank's handshake is two
request/answer rounds on the same REQ socket::

    client -> [b"kvwire_auth_v1", pp, tp]                       (hello; msgpack array)
    server <- [b"KVWIRE_CHALLENGE:" + challenge(40), clock]     (no payload, nothing secret)
    client -> [b"kvwire_auth_v1_proof", pp, tp, nonce(32), challenge(40), proof(32)]
    server <- [sealed payload, clock, tag(32)]                  (or a refusal)

* ``challenge`` = listener time (8) || random (16) || HMAC(listener-only key, both)[:16]. It
  costs the listener no state, so unauthenticated peers can ask for as many as the rate
  limit lets them without growing its memory. A challenge is accepted once, and only
  while it is younger than the challenge TTL; the listener-only key is new for every
  listener, so a restarted listener accepts no challenge of its predecessor.
* ``proof`` = HMAC-SHA256(K_mac, "client" label || challenge || nonce || pp || tp): the
  client holds the secret. Checked with ``hmac.compare_digest`` before any payload byte is
  touched; a client without the secret gets a refusal and nothing else.
* ``sealed`` = payload XOR SHAKE-256(K_seal || challenge || nonce): the metadata (memory
  keys included) is unreadable to an eavesdropper. ``tag`` = HMAC-SHA256(K_mac, "listener"
  label || challenge || nonce || pp || tp || clock || sealed): the answer comes from a
  holder of the secret, for this request (the client's fresh nonce), unmodified. A replayed
  or forged answer fails the tag. Encrypt-then-MAC, so nothing is decrypted before the tag
  checks out.
* ``K_mac`` and ``K_seal`` are HMAC-SHA256(secret, label): two keys from one secret, and
  the raw secret is never a MAC key.

How the two modes meet (``docs/security.md``): the hello has the shape of vLLM's request
(three elements, bin tag, the ranks the client really wants), so a vLLM listener that gets
one logs "unexpected message" and answers with its plain payload, which the client refuses
to use; it does not crash on it. A kvwire listener without a secret refuses the hello. A
plain request (vLLM's or kvwire's) to a listener with a secret is refused ("authentication
required"), so a vLLM client fails its decode and learns nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from kvwire.config.secret import check_secret
from kvwire.errors import HandshakeAuthError, WireDecodeError
from kvwire.wire.handshake import MAX_RANK

log = logging.getLogger(__name__)

AUTH_HELLO_TAG = b"kvwire_auth_v1"
AUTH_PROOF_TAG = b"kvwire_auth_v1_proof"
CHALLENGE_PREFIX = b"KVWIRE_CHALLENGE:"
NONCE_BYTES = 32
CHALLENGE_BYTES = 40
MAC_BYTES = 32

_CLIENT_LABEL = b"kvwire-auth-v1 client proof\x00"
_RECORD_LABEL = b"kvwire-auth-v1 store record\x00"
_LISTENER_LABEL = b"kvwire-auth-v1 listener answer\x00"
_RANKS = struct.Struct(">II")
_CLOCK_LEN = struct.Struct(">I")
_STAMP = struct.Struct(">Q")

_three = msgspec.msgpack.Decoder(tuple[bytes, int, int])
_six = msgspec.msgpack.Decoder(tuple[bytes, int, int, bytes, bytes, bytes])
_encoder = msgspec.msgpack.Encoder()


# -- the secret ----------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class AuthKeys:
    """The two keys derived from a secret; the repr shows neither."""

    mac: bytes
    seal: bytes

    @classmethod
    def derive(cls, secret: bytes) -> AuthKeys:
        secret = check_secret(secret)
        return cls(
            mac=hmac.digest(secret, b"kvwire-auth-v1 mac key", "sha256"),
            seal=hmac.digest(secret, b"kvwire-auth-v1 seal key", "sha256"),
        )

    def __repr__(self) -> str:
        return "AuthKeys(<hidden>)"


# -- the messages ----------------------------------------------------------------------------


@dataclass(frozen=True)
class AuthHello:
    pp_rank: int
    tp_rank: int


@dataclass(frozen=True)
class AuthProof:
    pp_rank: int
    tp_rank: int
    nonce: bytes
    challenge: bytes
    proof: bytes


def encode_hello(pp_rank: int, tp_rank: int) -> bytes:
    return _encoder.encode((AUTH_HELLO_TAG, pp_rank, tp_rank))


def encode_proof(msg: AuthProof) -> bytes:
    return _encoder.encode(
        (AUTH_PROOF_TAG, msg.pp_rank, msg.tp_rank, msg.nonce, msg.challenge, msg.proof)
    )


def read_auth_request(data: bytes) -> AuthHello | AuthProof | None:
    """The hello or proof in a request frame; None when the frame is neither (a plain
    request, or garbage for the plain decoder to name). Bad fields: ``WireDecodeError``."""
    if AUTH_HELLO_TAG not in data[:32]:
        return None
    try:
        tag, pp_rank, tp_rank = _three.decode(data)
        fields: tuple[bytes, ...] = ()
    except (msgspec.DecodeError, msgspec.ValidationError):
        try:
            tag, pp_rank, tp_rank, *rest = _six.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireDecodeError(f"authenticated handshake request: {exc}") from None
        fields = tuple(rest)
    if not (0 <= pp_rank < MAX_RANK and 0 <= tp_rank < MAX_RANK):
        raise WireDecodeError(f"authenticated handshake request names rank ({pp_rank}, {tp_rank})")
    if tag == AUTH_HELLO_TAG and not fields:
        return AuthHello(pp_rank, tp_rank)
    if tag == AUTH_PROOF_TAG and fields:
        nonce, challenge, proof = fields
        if (len(nonce), len(challenge), len(proof)) != (NONCE_BYTES, CHALLENGE_BYTES, MAC_BYTES):
            raise WireDecodeError("authenticated handshake proof: fields of the wrong length")
        return AuthProof(pp_rank, tp_rank, nonce, challenge, proof)
    raise WireDecodeError(f"authenticated handshake request: unexpected tag {tag[:32]!r}")


def _client_mac(keys: AuthKeys, challenge: bytes, nonce: bytes, pp: int, tp: int) -> bytes:
    return hmac.digest(keys.mac, _CLIENT_LABEL + challenge + nonce + _RANKS.pack(pp, tp), "sha256")


def _listener_mac(
    keys: AuthKeys, challenge: bytes, nonce: bytes, pp: int, tp: int, clock: bytes, sealed: bytes
) -> bytes:
    mac = hmac.new(keys.mac, _LISTENER_LABEL + challenge + nonce, "sha256")
    mac.update(_RANKS.pack(pp, tp) + _CLOCK_LEN.pack(len(clock)) + clock)
    mac.update(sealed)
    return mac.digest()


def _xor_keystream(keys: AuthKeys, challenge: bytes, nonce: bytes, data: bytes) -> bytes:
    """Seal or unseal: the keystream is unique per (challenge, nonce), so never reused."""
    if not data:
        return b""
    stream = hashlib.shake_256(keys.seal + challenge + nonce).digest(len(data))
    mixed = int.from_bytes(data, "little") ^ int.from_bytes(stream, "little")
    return mixed.to_bytes(len(data), "little")


# -- records published in a metadata store -------------------------------------------------


def _record_binding(key: bytes) -> bytes:
    """What a store record's keystream and tag are bound to besides its nonce: the key it
    is published under, so a record copied to another engine's or rank's key fails."""
    return hashlib.sha256(_RECORD_LABEL + key).digest()


def seal_record(secret: bytes, key: bytes, header: bytes, payload: bytes) -> tuple[bytes, bytes]:
    """``(seal, sealed payload)``: ``seal`` is the fresh nonce followed by the tag.

    The same keys, keystream and encrypt-then-MAC as a handshake answer; the tag covers
    the key, a fresh nonce, ``header`` (the record's other fields) and the sealed payload."""
    keys = AuthKeys.derive(secret)
    nonce = os.urandom(NONCE_BYTES)
    binding = _record_binding(key)
    sealed = _xor_keystream(keys, binding, nonce, payload)
    mac = hmac.new(keys.mac, _RECORD_LABEL + binding + nonce, "sha256")
    mac.update(_CLOCK_LEN.pack(len(header)) + header + sealed)
    return nonce + mac.digest(), sealed


def open_record(secret: bytes, key: bytes, header: bytes, seal: bytes, sealed: bytes) -> bytes:
    """The payload of a sealed record, once its tag checks out; HandshakeAuthError if not."""
    keys = AuthKeys.derive(secret)
    if len(seal) != NONCE_BYTES + MAC_BYTES:
        raise HandshakeAuthError("store record is not authenticated (no secret on its publisher?)")
    nonce, tag = seal[:NONCE_BYTES], seal[NONCE_BYTES:]
    binding = _record_binding(key)
    mac = hmac.new(keys.mac, _RECORD_LABEL + binding + nonce, "sha256")
    mac.update(_CLOCK_LEN.pack(len(header)) + header + sealed)
    if not hmac.compare_digest(mac.digest(), tag):
        raise HandshakeAuthError(
            "store record failed authentication (a different secret, or a tampered record)"
        )
    return _xor_keystream(keys, binding, nonce, sealed)


# -- the listener's side --------------------------------------------------------------------


class AuthRefused(Exception):
    """A proof the listener does not accept; the message is the refusal's reason."""


class Challenger:
    """Issues challenges and checks proofs for one listener. Owned by its serving thread."""

    def __init__(
        self,
        secret: bytes,
        *,
        challenge_ttl_s: float = 10.0,
        max_used: int = 65536,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keys = AuthKeys.derive(secret)
        self._cookie_key = os.urandom(32)
        self._ttl = challenge_ttl_s
        self._clock = clock
        self._max_used = max_used
        self._used: OrderedDict[bytes, float] = OrderedDict()
        """Challenges already answered, in the order they were issued, until they expire.
        Only holders of the secret can add to it."""

    def challenge(self) -> bytes:
        stamp = _STAMP.pack(int(self._clock() * 1000))
        body = stamp + os.urandom(16)
        return body + hmac.digest(self._cookie_key, body, "sha256")[:16]

    def accept(self, msg: AuthProof) -> None:
        """Raise ``AuthRefused`` unless the proof is fresh, ours and made with the secret."""
        body, cookie = msg.challenge[:24], msg.challenge[24:]
        if not hmac.compare_digest(cookie, hmac.digest(self._cookie_key, body, "sha256")[:16]):
            raise AuthRefused("authentication failed: challenge not issued by this listener")
        now = self._clock()
        issued = _STAMP.unpack(body[:8])[0] / 1000.0
        if not 0.0 <= now - issued <= self._ttl + 0.001:
            raise AuthRefused("authentication failed: challenge expired")
        expected = _client_mac(self._keys, msg.challenge, msg.nonce, msg.pp_rank, msg.tp_rank)
        if not hmac.compare_digest(expected, msg.proof):
            raise AuthRefused("authentication failed: wrong proof (is the secret the same?)")
        self._forget_expired(now)
        if msg.challenge in self._used:
            raise AuthRefused("authentication failed: challenge already used (replay)")
        if len(self._used) >= self._max_used:
            raise AuthRefused("authentication busy: too many handshakes in flight")
        self._used[msg.challenge] = issued + self._ttl

    def seal(self, msg: AuthProof, payload: bytes, clock: bytes) -> tuple[bytes, bytes]:
        """``(sealed payload, tag)`` for an accepted proof."""
        sealed = _xor_keystream(self._keys, msg.challenge, msg.nonce, payload)
        tag = _listener_mac(
            self._keys, msg.challenge, msg.nonce, msg.pp_rank, msg.tp_rank, clock, sealed
        )
        return sealed, tag

    def _forget_expired(self, now: float) -> None:
        while self._used:
            oldest, expires = next(iter(self._used.items()))
            if expires >= now:
                return
            del self._used[oldest]


# -- the client's side --------------------------------------------------------------------


class ClientAuth:
    """A client's half: builds hello and proof, checks and opens the listener's answer."""

    def __init__(self, secret: bytes) -> None:
        self._keys = AuthKeys.derive(secret)

    def __repr__(self) -> str:
        return "ClientAuth(<secret hidden>)"

    @staticmethod
    def hello(pp_rank: int, tp_rank: int) -> bytes:
        return encode_hello(pp_rank, tp_rank)

    @staticmethod
    def challenge_of(frame: bytes) -> bytes | None:
        """The challenge in a first answer frame, or None when it is not a challenge."""
        if not frame.startswith(CHALLENGE_PREFIX):
            return None
        challenge = frame[len(CHALLENGE_PREFIX) :]
        if len(challenge) != CHALLENGE_BYTES:
            raise HandshakeAuthError(f"peer sent a challenge of {len(challenge)} bytes")
        return challenge

    def prove(self, pp_rank: int, tp_rank: int, challenge: bytes) -> AuthProof:
        nonce = os.urandom(NONCE_BYTES)
        proof = _client_mac(self._keys, challenge, nonce, pp_rank, tp_rank)
        return AuthProof(pp_rank, tp_rank, nonce, challenge, proof)

    def open(self, sent: AuthProof, sealed: bytes, clock: bytes, tag: bytes) -> bytes:
        """The payload, once the tag shows it answers ``sent`` and comes from the secret."""
        expected = _listener_mac(
            self._keys, sent.challenge, sent.nonce, sent.pp_rank, sent.tp_rank, clock, sealed
        )
        if not hmac.compare_digest(expected, tag):
            raise HandshakeAuthError(
                "handshake answer failed authentication (a different secret, a tampered or "
                "a replayed answer)"
            )
        return _xor_keystream(self._keys, sent.challenge, sent.nonce, sealed)
