"""The engine-core half of ``KVWireConnector``: which requests hold or load KV, the step's
metadata for the workers, and the engine's one handshake listener."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvwire.config import KVWireConfig
from kvwire.errors import ConfigError
from kvwire.integrations.vllm import staging
from kvwire.integrations.vllm.config import readback
from kvwire.integrations.vllm.groups import exchanged, prefill_backoff
from kvwire.integrations.vllm.messages import BlockIds, KVWireHandshake, KVWireMetadata
from kvwire.sidechannel import HandshakeListener
from kvwire.sidechannel.advertise import advertised_host

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvwire")


class SchedulerSide:
    """Engine-core half: decisions per request, the step's metadata, the listener."""

    def __init__(
        self, vllm_config: VllmConfig, config: KVWireConfig, kv_cache_config: KVCacheConfig
    ) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.rules = exchanged(kv_cache_config, vllm_config)
        """Per transfer group, which of a request's blocks cross."""
        self.backoff = prefill_backoff(kv_cache_config, vllm_config)
        """The prompt's last tokens D computes itself (P leaves them out)."""
        self.listener = HandshakeListener(
            {}, host=config.side_channel_host, port=config.side_channel_port, secret=config.secret
        ).start()
        self.host = advertised_host(config.side_channel_host, config.advertise_host)
        """The address P's params name (a wildcard bind resolved once, here)."""
        self.meta = KVWireMetadata()
        self.sending: set[str] = set()
        self.started: set[str] = set()
        self.loading: set[str] = set()
        """D: requests whose KV is being fetched (vLLM holds their blocks until the
        worker reports them received, aborted ones included)."""
        self.streaming = bool(config.stream_layers) and config.mode == "push"
        """P writes prompts while computing them (push with ``stream_layers``)."""
        self.staged = staging.wants_host_buffer(vllm_config)
        """P copies each step's computed blocks to its host buffer (``kv_buffer_device``)."""
        self.prompts: dict[str, Request] = {}
        """P, streaming or staged: the requests a remote decode will read, from their first
        scheduling to their end."""
        self.staged_from: dict[str, int] = {}
        """P, staged: per prompt, the token its next chunk starts copying from (0 at first:
        a prefix-cache hit's blocks may never have been copied)."""
        self.kv_cache_manager: KVCacheManager | None = None
        """vLLM's, bound by its scheduler: where a computing prompt's blocks are."""
        self.readback = readback(vllm_config, kv_cache_config)
        """``bidirectional_kv_xfer``: D keeps a finished conversation's blocks, P reads them
        back for the next turn (None: off, or not for this model)."""

    @property
    def port(self) -> int:
        return self.listener.port

    def set_handshakes(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        payloads = {}
        for rank, meta in metadata.items():
            if not isinstance(meta, KVWireHandshake):
                raise ConfigError(f"worker {rank} sent {type(meta).__name__}, not kvwire's")
            payloads[(0, int(rank))] = meta.payload
        self.listener.set_payloads(payloads)

    def on_new_request(self, request: Request) -> None:
        """P: a prompt whose last tokens D computes itself (:func:`prefill_backoff`) is
        cut to the rest before vLLM schedules it, as a stock P cuts it, so P computes and
        sends exactly what D loads and D reads no token P never computed. Once: vLLM may
        hand a preempted request back, and it stays cut. Not a request that skips reading
        the prefix cache (prompt logprobs): vLLM loads nothing for it on D, which computes
        the whole prompt, and P must answer for every prompt token (stock 0.32 too)."""
        params = request.kv_transfer_params
        backoff = self.backoff
        if (
            not backoff
            or not params
            or not params.get("do_remote_decode")
            or params.get("_p_side_truncated")
            or request.num_prompt_tokens <= backoff
            or request.get_skip_reading_prefix_cache()
        ):
            return
        if request.prompt_token_ids is not None:
            del request.prompt_token_ids[-backoff:]
        elif request.prompt_embeds is not None:
            request.prompt_embeds = request.prompt_embeds[:-backoff]
        else:
            return
        del request._all_token_ids[-backoff:]
        request.num_prompt_tokens -= backoff
        request.max_tokens = 1
        params["_p_side_truncated"] = True

    def loaded_tokens(self, prompt: int) -> int:
        """D: how many of a prompt's tokens come from P (the rest D computes)."""
        return prompt - self.backoff if self.backoff and prompt > self.backoff else prompt

    def get_num_new_matched_tokens(self, request: Request, computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = self.loaded_tokens(len(request.prompt_token_ids or [])) - computed
            if count > 0:
                return count, True
        elif self.readback is not None and self.readback.moves and self.reads_back(params):
            count = self.held_tokens(request, params) - computed
            if count > 0 and count >= self.readback.threshold:
                return count, True
        return 0, False

    def reads_back(self, params: dict[str, Any] | None) -> bool:
        """P, ``bidirectional_kv_xfer``: the prompt comes with params of a decode engine
        that kept the conversation so far (once: the read is not started twice)."""
        return bool(
            params
            and params.get("do_remote_decode")
            and params.get("remote_block_ids")
            and not params.get("_remote_blocks_processed")
            and all(params.get(key) for key in _PEER_KEYS)
        )

    @staticmethod
    def held_tokens(request: Request, params: dict[str, Any]) -> int:
        """P: how many of the prompt's first tokens the decode engine holds."""
        held = params.get("remote_num_tokens") or 0
        return min(int(held), int(request.num_prompt_tokens))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            if self.streaming or self.staged:
                self.prompts[request.request_id] = request
            if request.request_id not in self.started:  # once, not per prefill chunk
                self.started.add(request.request_id)
                self.meta.started.append(request.request_id)
            if self.readback is not None and self.reads_back(params):
                self._read_back(request, blocks, num_external_tokens, params)
            return
        if not params or not params.get("do_remote_prefill"):
            return
        local: BlockIds = []
        if num_external_tokens > 0:
            local = self.exchanged(blocks.get_unhashed_block_ids_all_groups())
            self.loading.add(request.request_id)
        prompt = self.loaded_tokens(int(request.num_prompt_tokens)) or None
        self.meta.to_recv[request.request_id] = (dict(params), local, prompt)
        params["do_remote_prefill"] = False  # one transfer per request

    def _read_back(
        self,
        request: Request,
        blocks: KVCacheBlocks,
        num_external_tokens: int,
        params: dict[str, Any],
    ) -> None:
        """P: read the conversation's first tokens from the decode engine into the blocks
        vLLM allocated for them (none: a local prefix hit, too few to be worth it, or a
        model kvwire does not read back; D is then only told that it may free its
        blocks)."""
        rid = request.request_id
        local: BlockIds = []
        if num_external_tokens > 0:
            local = self.exchanged(blocks.get_unhashed_block_ids_all_groups())
            self.loading.add(rid)
        self.meta.to_recv[rid] = (dict(params), local, self.held_tokens(request, params))
        self.meta.read_back.add(rid)
        params["_remote_blocks_processed"] = True

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        """Whether vLLM must keep the request's blocks (until the worker reports it sent),
        and the params for D.

        P holds a finished prompt's blocks for D. Any other end on P frees them at once,
        a streaming prompt's too, although a round of its writes may still be in flight
        and read blocks vLLM hands to another request meanwhile: a stream only reads P's
        blocks, so nothing of P's changes, and what such a round carries lands in D's
        blocks of a request that is never completed (the completion rides only on the
        round posted after the prompt finished, and the producer posts nothing after the
        abort). D gives those blocks back only when no write of P's can still land in them
        (kvwire bounds its writes by D's registration watchdog). vLLM's preemption frees
        blocks the same way; the producer then writes the prompt again from its new
        blocks, after the round in flight landed."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        rid = request.request_id
        self.started.discard(rid)
        self.prompts.pop(rid, None)
        self.staged_from.pop(rid, None)
        if rid in self.loading:
            # D: aborted while its KV is in flight; the worker ends the fetch and reports
            # the request received, which is when vLLM frees its blocks.
            self.meta.to_abort.append(rid)
            return False, None
        if params.get("do_remote_prefill"):
            # D: never allocated (aborted while queued): P must still free its blocks.
            self.meta.to_recv[rid] = (dict(params), [], None)
            params["do_remote_prefill"] = False
            return False, None
        if self.readback is not None and self.reads_back(params):
            # P: a read-back never allocated (aborted while queued): D frees its blocks now
            # rather than when their hold runs out.
            self.meta.to_recv[rid] = (dict(params), [], self.held_tokens(request, params))
            self.meta.read_back.add(rid)
            params["_remote_blocks_processed"] = True
        prefill = bool(params.get("do_remote_decode"))
        if not prefill and (self.readback is None or not self.readback.moves):
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            if prefill:
                self.meta.to_abort.append(rid)
            return False, None
        groups = self.exchanged(block_ids)
        if not any(groups):
            return False, None
        if prefill and any(r.gaps and 0 in g for g, r in zip(groups, self.rules, strict=True)):
            # vLLM freed a whole R-SWA block between the prompt's last block and the decode
            # window (P decoded that far past its prompt, or a session's prompt holds an
            # earlier turn's decode): a D whose prompt reaches into it would read vLLM's null
            # block as P's KV, and kvwire's transfer holds each block once, so nothing is
            # offered and D computes the prompt (a stock P offers the list, placeholders too).
            log.warning(
                "KV of %s not offered: vLLM freed R-SWA blocks inside its list (%d tokens "
                "computed, a %d-token prompt)",
                rid, request.num_computed_tokens, request.num_prompt_tokens,
            )  # fmt: skip
            self.meta.to_abort.append(rid)
            return False, None
        cfg = self.config
        lease = cfg.lease_s if cfg.mode == "pull" else None
        if not prefill:
            # D, read-back: the conversation is kept for the next turn's prefill.
            assert self.readback is not None
            lease = self.meta.held_s[rid] = self.readback.hold_s
        self.meta.to_send[rid] = (self.held(groups), int(request.num_computed_tokens))
        self.sending.add(rid)
        parallel = self.vllm_config.parallel_config
        return True, {
            "do_remote_prefill": prefill,
            "do_remote_decode": not prefill,
            "remote_block_ids": groups,
            "remote_engine_id": cfg.engine_id,
            "remote_request_id": rid,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": cfg.tp_size,
            "dcp_size": parallel.decode_context_parallel_size,
            "pp_size": parallel.pipeline_parallel_size,
            "remote_num_tokens": int(request.num_computed_tokens),
            "remote_blocks_expiry_time": None if lease is None else time.perf_counter() + lease,
        }

    def exchanged(self, block_ids: Any) -> BlockIds:
        """A request's block lists as stock engines exchange them (so a stock peer reads
        what it expects): one per transfer group, each cut by its rule
        (:class:`~kvwire.integrations.vllm.groups.Exchanged`); a sliding window's tail may
        still begin with the null block."""
        groups = self._transfer_lists(block_ids)
        return [rule(g) for g, rule in zip(groups, self.rules, strict=True)]

    def held(self, groups: BlockIds) -> BlockIds:
        """P: the exchanged lists as its own transfer holds them
        (:meth:`~kvwire.integrations.vllm.groups.Exchanged.held`); D gets them whole. (D's
        own lists need nothing: vLLM's unhashed blocks leave the null block out.)"""
        return [rule.held(g) for g, rule in zip(groups, self.rules, strict=True)]

    def _transfer_lists(self, block_ids: Any) -> BlockIds:
        """A request's block lists, one per transfer group (vLLM leaves some groups out)."""
        groups = _groups(block_ids)
        if len(groups) == len(self.kv_cache_config.kv_cache_groups):
            groups = [list(g) for g in self.kv_cache_config.select_transfer_block_ids(groups)]
        return groups

    def written(self, block_ids: Any, start: int, end: int) -> BlockIds:
        """The blocks computing tokens ``[start, end)`` writes, per transfer group: an
        attention group's blocks holding those tokens, a Mamba group's running state (its
        list has no block per token)."""
        engine = int(self.vllm_config.cache_config.block_size)
        out = []
        for g, rule in zip(self._transfer_lists(block_ids), self.rules, strict=True):
            size = rule.block_size or engine
            out.append(
                rule(g) if rule.spec_slots is not None else g[start // size : -(-end // size)]
            )
        return out

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVWireMetadata:
        meta, self.meta = self.meta, KVWireMetadata()
        if self.prompts:
            self._stream_facts(meta, scheduler_output)
        return meta

    def _stream_facts(self, meta: KVWireMetadata, scheduler_output: SchedulerOutput) -> None:
        """P, streaming: the chunk each prompt computes this step and what vLLM preempted.
        vLLM builds the metadata before it counts the step's tokens as computed, so a
        request's ``num_computed_tokens`` is where its chunk begins."""
        manager = self.kv_cache_manager
        if manager is None:  # an engine that binds no cache manager: prompts go whole
            if self.staged:
                raise ConfigError(
                    "kv_buffer_device 'cpu': the host buffer is filled step by step from the "
                    "blocks vLLM's cache manager names, and this vLLM bound none"
                )
            return
        prompts = self.prompts
        preempted = [r for r in scheduler_output.preempted_req_ids or () if r in prompts]
        if self.streaming:
            meta.preempted.extend(preempted)
        for rid in preempted:  # computed again, into whatever blocks it gets
            self.staged_from.pop(rid, None)
        for rid, count in scheduler_output.num_scheduled_tokens.items():
            request = prompts.get(rid)
            if request is None:
                continue
            start, prompt = int(request.num_computed_tokens), int(request.num_prompt_tokens)
            if start < prompt:
                end = min(start + int(count), prompt)
                if self.streaming:
                    meta.chunks[rid] = (self.exchanged(manager.get_block_ids(rid)), end, prompt)
                if self.staged:
                    first = self.staged_from.get(rid, 0)
                    self.staged_from[rid] = end
                    meta.staged[rid] = self.written(manager.get_block_ids(rid), first, end)

    def update_output(self, output: KVConnectorOutput) -> None:
        self.sending -= set(output.finished_sending or ())
        self.loading -= set(output.finished_recving or ())

    def close(self) -> None:
        self.listener.close()


_PEER_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
"""What params must name for a read (stock ignores params that lack any of them)."""


def _groups(block_ids: Any) -> BlockIds:
    """vLLM hands a connector without hybrid-manager support one group's flat id list;
    the params (vLLM's own format) carry a list per group."""
    ids = list(block_ids)
    if ids and not isinstance(ids[0], int):
        return [[int(b) for b in group] for group in ids]
    return [[int(b) for b in ids]]
