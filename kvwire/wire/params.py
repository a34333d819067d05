"""``kv_transfer_params``: the dict that travels from P through the proxy to D, typed.

It is the one message that is not msgpack on our wire: P returns it inside its HTTP answer
(JSON), so it reaches us as a dict, JSON text, or (from tools) msgpack. The view keeps
exactly the keys P set (unset ones are ``None``) so :meth:`as_dict` gives the dict back;
:meth:`req_meta` applies vLLM's reading rules (sizes default to 1, the remote fields are
required) and produces what a consumer needs to fetch the blocks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from kvwire.errors import WireDecodeError, WireEncodeError
from kvwire.wire.codec import (
    DEFAULT_MAX_SIZE,
    check_size,
    convert,
    decode_struct,
    encode_struct,
)
from kvwire.wire.schemas import BlockIds, NonNegInt, Port, PositiveInt, TransferMode

# Keys a consumer cannot do without: where the blocks are and whose they are.
_REQUIRED_FOR_RECV = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)


class RemoteMetaV13(msgspec.Struct, frozen=True, gc=False):
    """Where a consumer finds one request's KV blocks (vLLM ``RemoteMeta``)."""

    block_ids: BlockIds
    host: str
    port: Port
    engine_id: str
    request_id: str
    blocks_expiry_time: float | None = None
    num_tokens: int | None = None


class RemoteMetaV15(RemoteMetaV13, frozen=True, gc=False):
    """v13 plus the producer's registration generation (vLLM 0.33.0)."""

    registration_generation: int = 0


class ReqMetaV13(msgspec.Struct, frozen=True, gc=False):
    """The wire-derived half of vLLM's ``ReqMeta``: sizes with defaults applied, the remote."""

    tp_size: int
    dcp_size: int
    pp_size: int
    remote_block_size: int | None
    remote: RemoteMetaV13


class ReqMetaV15(ReqMetaV13, frozen=True, gc=False):
    """:class:`ReqMetaV13` carrying a v15 :class:`RemoteMetaV15` (same field, same place)."""

    remote: RemoteMetaV15


class KVTransferParamsV13(msgspec.Struct, frozen=True, gc=False):
    """The typed view of v13/v14 ``kv_transfer_params``. Unknown keys are ignored."""

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_block_ids: BlockIds | None = None
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: Port | None = None
    tp_size: PositiveInt | None = None
    dcp_size: PositiveInt | None = None
    pp_size: PositiveInt | None = None
    remote_block_size: PositiveInt | None = None
    remote_blocks_expiry_time: float | None = None
    remote_num_tokens: NonNegInt | None = None
    transfer_mode: TransferMode | None = None

    def as_dict(self) -> dict[str, Any]:
        """The dict P would send: every key that was set, none that was not."""
        return {k: v for k, v in msgspec.to_builtins(self).items() if v is not None}

    def missing_for_recv(self) -> list[str]:
        """Keys a consumer needs that are absent (empty when D can fetch the blocks)."""
        return [name for name in _REQUIRED_FOR_RECV if getattr(self, name) is None]

    def req_meta(self) -> ReqMetaV13:
        """What a consumer needs to fetch the blocks; missing keys raise WireDecodeError."""
        return ReqMetaV13(**self._sizes(), remote=RemoteMetaV13(**self._remote_fields()))

    def _sizes(self) -> dict[str, Any]:
        """The peer's sizes, unset ones defaulting to 1 as vLLM reads them."""
        return {
            "tp_size": self.tp_size or 1,
            "dcp_size": self.dcp_size or 1,
            "pp_size": self.pp_size or 1,
            "remote_block_size": self.remote_block_size,
        }

    def _remote_fields(self) -> dict[str, Any]:
        missing = self.missing_for_recv()
        if missing:
            raise WireDecodeError(f"kv_transfer_params lacks {', '.join(missing)}")
        return {
            "block_ids": self.remote_block_ids,
            "host": self.remote_host,
            "port": self.remote_port,
            "engine_id": self.remote_engine_id,
            "request_id": self.remote_request_id,
            "blocks_expiry_time": self.remote_blocks_expiry_time,
            "num_tokens": self.remote_num_tokens,
        }


class KVTransferParamsV15(KVTransferParamsV13, frozen=True, gc=False):
    """v13 plus ``remote_registration_generation`` (vLLM 0.33.0)."""

    remote_registration_generation: NonNegInt | None = None

    def req_meta(self) -> ReqMetaV15:
        """As in v13, the remote carrying the registration generation (default 0)."""
        remote = RemoteMetaV15(
            **self._remote_fields(),
            registration_generation=self.remote_registration_generation or 0,
        )
        return ReqMetaV15(**self._sizes(), remote=remote)


AnyKVTransferParams = KVTransferParamsV13 | KVTransferParamsV15


def params_type(version: int) -> type[KVTransferParamsV13]:
    """The kv_transfer_params class of a protocol version."""
    return KVTransferParamsV15 if version >= 15 else KVTransferParamsV13


def parse_kv_transfer_params(
    params: Mapping[str, Any] | bytes | bytearray | memoryview | str,
    *,
    version: int = 13,
    max_size: int = DEFAULT_MAX_SIZE,
) -> KVTransferParamsV13:
    """Validate ``kv_transfer_params`` given as a dict, JSON text/bytes or msgpack bytes.

    Returns :class:`KVTransferParamsV15` for ``version >= 15``. Anything malformed raises
    :class:`WireDecodeError`.
    """
    cls = params_type(version)
    if isinstance(params, Mapping):
        return convert(dict(params), cls, what="kv_transfer_params")
    if isinstance(params, str):
        if params.lstrip()[:1] != "{":  # text is JSON; msgpack travels as bytes
            raise WireDecodeError("kv_transfer_params: text must be a JSON object")
        try:
            params = params.encode()
        except UnicodeEncodeError:  # lone surrogates: text no peer could have sent
            raise WireDecodeError("kv_transfer_params: text is not valid Unicode") from None
    check_size(params, max_size, "kv_transfer_params")
    raw = bytes(params)
    if raw.lstrip()[:1] == b"{":
        return _parse_json(raw, cls)
    return decode_struct(raw, cls, max_size=max_size, what="kv_transfer_params")


def _parse_json(raw: bytes, cls: type[KVTransferParamsV13]) -> KVTransferParamsV13:
    """JSON as a peer sends it: UTF-8 whose strings are valid Unicode.

    ``json.loads`` alone lets lone surrogates in (from bytes it decodes with
    ``surrogatepass``, and from ``\\udXXX`` escapes); such a string could not be written
    back as msgpack, so it is refused here. Only input holding such an escape pays
    for the re-encode that finds them.
    """
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise WireDecodeError("kv_transfer_params: JSON is not valid UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise WireDecodeError(f"kv_transfer_params: invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise WireDecodeError("kv_transfer_params: JSON is not an object")
    result = convert(obj, cls, what="kv_transfer_params")
    if b"\\ud" in raw or b"\\uD" in raw:
        try:
            encode_struct(result.as_dict())
        except WireEncodeError:
            raise WireDecodeError("kv_transfer_params: a string is not valid Unicode") from None
    return result
