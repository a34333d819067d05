"""The decode side: receive a request's KV into blocks the engine allocated.

An engine calls :meth:`Consumer.add_request` with the ``kv_transfer_params`` the proxy
forwarded and the blocks it allocated (or later, :meth:`Consumer.blocks_allocated`), then
asks :meth:`Consumer.get_finished` which requests have their KV and which failed — with
the blocks whose contents must not be trusted, to recompute them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvwire.errors import ConfigError, LocalProtocolError
from kvwire.machine import (
    Abort,
    AllocationDone,
    Event,
    FreeBlocks,
    RemotePrefill,
    RequestAdded,
    RequestDone,
    RequestFailed,
)
from kvwire.runtime._endpoint import _Endpoint
from kvwire.runtime.arguments import (
    block_ids_arg,
    num_tokens_arg,
    params_arg,
    request_id_arg,
)
from kvwire.runtime.driver import Outcome
from kvwire.runtime.producer import BlockIdsLike
from kvwire.wire.params import parse_kv_transfer_params


@dataclass(frozen=True)
class RequestFailure:
    """Why a request ended without its KV, and which local blocks to recompute."""

    invalid_block_ids: tuple[tuple[int, ...], ...]
    reason: str
    """``handshake``, ``transfer``, ``expired``, ``timeout``, ``aborted`` or ``protocol``."""
    detail: str = ""
    writes_until: float | None = None
    """Push: the producer may still write into these blocks until this ``perf_counter``
    time (our registration's watchdog: kvwire producers end every write before it); reuse
    them for another request only after it."""


@dataclass
class Finished:
    """Requests that ended since the last :meth:`Consumer.get_finished`."""

    done: list[str] = field(default_factory=list)
    failed: dict[str, RequestFailure] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.done or self.failed)


class Consumer(_Endpoint[Finished]):
    """One decode rank's transfer runtime (see :class:`~kvwire.runtime.Producer` for
    ``transport``)."""

    _role = "consumer"

    # -- setup ---------------------------------------------------------------------

    def handshake_payload(self) -> bytes:
        """This rank's handshake answer (push mode: producers fetch it to write to us)."""
        return self._driver.handshake_payload()

    # -- engine calls --------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        kv_transfer_params: Mapping[str, Any] | bytes | str,
        block_ids: BlockIdsLike | None = None,
        *,
        num_tokens: int | None = None,
        readback: bool = False,
    ) -> None:
        """Request ``request_id`` arrived with the producer's params; with ``block_ids`` the
        blocks to fill are allocated too (else call :meth:`blocks_allocated` later).

        ``num_tokens`` is where this consumer's lists end, the tokens it loads; without it
        the params' count (``remote_num_tokens``, the tokens the producer computed) stands
        in. A consumer whose blocks are smaller than the producer's needs one of them to
        place the prompt's end. A producer that computed more (it generated past the
        prompt) has its lists placed by its own count: pulling, the tokens ``num_tokens``
        asks for move when the producer still holds them and the request fails by name
        when it clipped some away (a window); pushing, the producer places this consumer's
        lists by its count alone (vLLM's PUSH_REG carries none), so counts that differ
        are refused here. ``readback``: read only the first ``num_tokens`` tokens of what
        the producer holds, which may be more (a prefill engine reading back a
        conversation a decode engine kept: the new prompt shares its beginning);
        ``num_tokens`` is then required. Malformed params raise ``WireDecodeError``,
        arguments that cannot be honoured ``LocalProtocolError`` naming them.
        """
        if self._driver.machine is None:
            raise ConfigError("register_kv_caches before add_request")
        request_id_arg(request_id)
        params = parse_kv_transfer_params(
            params_arg(kv_transfer_params), version=self.config.version
        )
        blocks = None if block_ids is None else block_ids_arg(block_ids, self._driver.geometry)
        meta = params.req_meta()
        remote = meta.remote
        pull = self.config.mode == "pull"
        prefill = RemotePrefill(
            engine_id=remote.engine_id,
            request_id=remote.request_id,
            host=remote.host,
            port=remote.port,
            block_ids=tuple(tuple(g) for g in remote.block_ids) if pull else (),
            tp_size=meta.tp_size,
            pp_size=meta.pp_size,
            dcp_size=meta.dcp_size,
            blocks_expiry_time=remote.blocks_expiry_time,
        )
        tokens = num_tokens_arg(num_tokens)
        if readback and tokens is None:
            raise LocalProtocolError("readback needs num_tokens: how many tokens to read back")
        events: list[Event] = [RequestAdded(request_id, remote=prefill)]
        if blocks is not None:
            events.append(AllocationDone(request_id, blocks))
        computed = None if readback else remote.num_tokens
        if tokens is None:
            tokens = computed
        elif computed is not None and computed != tokens and (computed < tokens or not pull):
            raise LocalProtocolError(
                f"request {request_id!r}: num_tokens {tokens}, and the producer computed "
                f"{computed} tokens: "
                + (
                    "it cannot send tokens it never computed"
                    if computed < tokens
                    else "a pushing producer places this consumer's blocks by its own count"
                )
            )
        # The planner places a list longer than the tokens need as starting with them.
        self._driver.request_started(request_id, tokens, computed)
        self._driver.feed(*events)

    def blocks_allocated(self, request_id: str, block_ids: BlockIdsLike) -> None:
        """The blocks to fill (only the uncomputed suffix; empty if all hit the prefix cache)."""
        request_id_arg(request_id)
        blocks = block_ids_arg(block_ids, self._driver.geometry)
        self._driver.feed(AllocationDone(request_id, blocks))

    def abort(self, request_id: str) -> None:
        self._driver.feed(Abort(request_id_arg(request_id)))

    def get_finished(self) -> Finished:
        """Requests done or failed since the last call."""
        return self._take_finished()

    # -- internals -----------------------------------------------------------------

    def _empty_finished(self) -> Finished:
        return Finished()

    def _on_outcome(self, action: Outcome) -> None:
        if isinstance(action, FreeBlocks):  # pragma: no cover - producer only
            return
        with self._cv:
            if isinstance(action, RequestDone):
                self._finished.done.append(action.request_id)
            else:
                assert isinstance(action, RequestFailed)
                self._finished.failed[action.request_id] = RequestFailure(
                    action.invalid_block_ids,
                    action.reason.value,
                    action.detail,
                    action.writes_until,
                )
            self._cv.notify_all()
