"""Engines for interop tests: a real vLLM engine (interop/vllm_peer.py processes) and a
kvwire engine (kvwire.demo's engines: one kvwire.runtime rank process per TP rank).

Both sides fill and check KV bytes with ``kvwire.demo.content``; a request is identified by
its id and a content index. Waiting loops step the vLLM engine (its scheduler builds the
metadata, every worker runs ``start_load_kv`` and ``get_finished``) as vLLM's engine loop does.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvwire.demo.engines import DecodeEngine, EngineOptions, PrefillEngine
from kvwire.demo.models import CacheSpec, preset
from kvwire.framing import FrameWriter, read_frame, wait_or_kill
from kvwire.testing.ports import free_port
from kvwire.wire.compat import CompatFactors
from kvwire.wire.versions import VLLM_RELEASES

PEER = Path(__file__).with_name("vllm_peer.py")
BLOCK = 32  # CPU_ATTN kernel blocks are multiples of 32 tokens
VLLM_VERSION = importlib.metadata.version("vllm")
"""The vLLM this suite runs in (``make interop`` runs it in each interop venv): the
kvwire engines here say what an engine of that release says."""
PROTOCOL_VERSION = {v: k for k, v in VLLM_RELEASES.items()}[VLLM_VERSION]


class PeerError(RuntimeError):
    pass


class Zygote:
    """A vllm_peer.py fork server for one vLLM version: imports vLLM once; every peer is a
    fork of it (a separate process with its own NIXL agent, as vLLM's ranks are)."""

    def __init__(self, python: str = sys.executable, tmp: str | None = None) -> None:
        self.path = os.path.join(tmp or tempfile.mkdtemp(prefix="vllm-zygote-"), "sock")
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONUNBUFFERED": "1"}
        env.setdefault("UCX_NET_DEVICES", "lo")
        self.proc = subprocess.Popen(
            [python, str(PEER), "--zygote", self.path], stdout=subprocess.PIPE, env=env
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != b"ready":
            self.proc.kill()
            raise PeerError(f"vLLM zygote did not start ({self.proc.wait()})")

    def connect(self) -> socket.socket:
        mine, theirs = socket.socketpair()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.path)
            socket.send_fds(conn, [b"peer"], [theirs.fileno()])
        theirs.close()
        return mine

    def close(self) -> None:
        if self.proc.poll() is None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.path)
                conn.sendall(b"quit")
            wait_or_kill(self.proc, 10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Peer:
    """One forked vllm_peer.py process (a scheduler or a worker)."""

    def __init__(self, start: dict[str, Any], zygote: Zygote, env: dict[str, str]) -> None:
        self.sock = zygote.connect()
        self._out = FrameWriter(self.sock.makefile("wb"))
        self._in = self.sock.makefile("rb")
        self.log: list[str] = []
        self._out.send({**start, "env": env})
        self.hello = self._answer()

    def _answer(self) -> dict[str, Any]:
        msg = read_frame(self._in)
        if msg is None:
            raise PeerError(f"vLLM peer exited; log: {self.log[-5:]}")
        self.log.extend(msg.get("log", []))
        if not msg.get("ok"):
            raise PeerError(f"{msg.get('error')}; log: {self.log[-5:]}")
        return msg

    def send(self, cmd: dict[str, Any]) -> None:
        self._out.send(cmd)

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self._out.send(cmd)
        return self._answer()

    def close(self) -> None:
        """Ask the peer to exit and wait for its stream to end (it shut down)."""
        try:
            self._out.send({"op": "exit"})
            while read_frame(self._in) is not None:
                pass
        except OSError:
            pass
        self._in.close()
        self.sock.close()


@dataclass
class Geometry:
    model: str = "llama-3-8b"
    layers: int = 2
    num_blocks: int = 32
    block_size: int = BLOCK
    kv_heads: int = 0
    """KV heads in all (0: the model's); 1 with Llama-3-70B is one rank of a TP-8 engine.
    Read by :class:`SchedulerEngine` only (the hash factors here are the model's)."""

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one attention layer, every head: what D checks per token."""
        spec = CacheSpec(preset(self.model), self.layers, self.num_blocks, 0, 1, self.block_size)
        return spec.block_len // self.block_size


def factors(
    geo: Geometry, mode: str, *, backend: str | None = None, hma: bool | None = True
) -> dict[str, Any]:
    """The compatibility factors a vLLM engine (this suite's release) with the NIXL
    connector hashes for this model, as a dict a kvwire rank turns into ``CompatFactors``.

    ``is_hma_enabled`` is true there, on CPU too: ``CpuPlatform.support_hybrid_kv_cache()``
    returns True (vllm/platforms/cpu.py:604) and NixlConnector supports HMA, so VllmConfig
    resolves the hybrid manager on. ``hma=None`` leaves kvwire's own default."""
    m = preset(geo.model)
    kwargs: dict[str, Any] = dict(
        vllm_version=VLLM_VERSION,
        connector_version=PROTOCOL_VERSION,
        model=m.hf_name,
        dtype="bfloat16",
        num_kv_heads=1 if m.mla else m.kv_heads,
        head_size=m.latent_dim if m.mla else m.head_dim,
        num_hidden_layers=m.num_layers,
        attn_backend_name=backend or ("CPU_MLA" if m.mla else "CPU_ATTN"),
        transfer_mode=mode,
    )
    if hma is not None:
        kwargs["is_hma_enabled"] = hma
    import msgspec

    return msgspec.to_builtins(CompatFactors.build(**kwargs))


@dataclass
class VllmEngine:
    """A vLLM engine: one scheduler process and ``tp`` worker processes."""

    role: str  # "P" or "D"
    mode: str
    tp: int
    geo: Geometry = field(default_factory=Geometry)
    lease: int = 30
    hma: bool | None = None
    zygote: Zygote | None = None
    engine_id: str = ""
    extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.engine_id = self.engine_id or f"vllm-{self.role}-{os.getpid()}-{id(self) % 10000}"
        assert self.zygote is not None, "a VllmEngine needs a Zygote"
        self.port = free_port()
        env = {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port),
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
        }
        base = {
            "role": self.role, "mode": self.mode, "engine_id": self.engine_id,
            "tp_size": self.tp, "model": self.geo.model, "layers": self.geo.layers,
            "num_blocks": self.geo.num_blocks, "block_size": self.geo.block_size,
            "lease": self.lease, "hma": self.hma, "layout": "LBHNC",
            "extra_config": self.extra_config,
        }  # fmt: skip
        self.workers: list[Peer] = []
        self.scheduler: Peer | None = None
        try:
            self.scheduler = Peer({**base, "part": "scheduler"}, self.zygote, env)
            for rank in range(self.tp):
                start = {**base, "part": "worker", "tp_rank": rank}
                self.workers.append(Peer(start, self.zygote, env))
            payloads = {str(r): w.hello["payload"] for r, w in enumerate(self.workers)}
            self.scheduler.call({"op": "serve", "payloads": payloads})
        except BaseException:
            self.close()
            raise
        self._free = list(range(self.geo.num_blocks))
        self._sending: dict[str, int] = {}
        self._recving: dict[str, int] = {}
        self.freed: set[str] = set()
        self.received: set[str] = set()
        self.invalid: set[int] = set()

    @property
    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.geo.layers)]

    @property
    def log(self) -> list[str]:
        assert self.scheduler is not None
        return [*self.scheduler.log, *(line for w in self.workers for line in w.log)]

    def take_blocks(self, n: int) -> list[int]:
        blocks, self._free = self._free[:n], self._free[n:]
        assert len(blocks) == n, "vLLM engine out of blocks"
        return blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.geo.block_size)

    # -- P ---------------------------------------------------------------------------
    def prefill(self, rid: str, index: int, num_tokens: int) -> dict[str, Any]:
        """Schedule, compute (fill) and finish a prompt; returns P's kv_transfer_params."""
        assert self.scheduler is not None
        blocks = self.take_blocks(self.blocks_for(num_tokens))
        for w in self.workers:
            w.call({"op": "fill", "index": index, "blocks": blocks})
        self.scheduler.call({"op": "prefill", "rid": rid, "num_tokens": num_tokens,
                             "blocks": blocks})  # fmt: skip
        self.step()
        answer = self.scheduler.call({"op": "finish", "rid": rid})
        assert answer["delay"], "vLLM P did not hold the blocks"
        self.step()
        params: dict[str, Any] = answer["params"]
        return params

    # -- D ---------------------------------------------------------------------------
    def add(
        self,
        rid: str,
        index: int,
        params: dict[str, Any],
        num_tokens: int,
        hit: int = 0,
        *,
        allocate: bool = True,
    ) -> list[int]:
        """D: the request arrives; with ``allocate`` its blocks too (``hit`` leading
        blocks are local prefix-cache hits), else it waits (see :meth:`allocate`)."""
        assert self.scheduler is not None
        self.scheduler.call({"op": "add", "rid": rid, "params": params,
                             "num_tokens": num_tokens})  # fmt: skip
        return self.allocate(rid, index, num_tokens, hit) if allocate else []

    def allocate(self, rid: str, index: int, num_tokens: int, hit: int = 0) -> list[int]:
        assert self.scheduler is not None
        blocks = self.take_blocks(self.blocks_for(num_tokens))
        for w in self.workers:
            w.call({"op": "prepare", "index": index, "blocks": blocks, "hit": hit})
        self.scheduler.call({"op": "alloc", "rid": rid, "blocks": blocks, "hit": hit})
        return blocks

    def check(self, index: int, blocks: list[int]) -> tuple[int, int]:
        wrong = checked = 0
        for w in self.workers:
            a = w.call({"op": "check", "index": index, "blocks": blocks})
            wrong += a["wrong"]
            checked += a["checked"]
        return wrong, checked

    def done(self, rid: str) -> None:
        assert self.scheduler is not None
        self.scheduler.call({"op": "done", "rid": rid})

    # -- the engine loop -------------------------------------------------------------
    def step(self) -> None:
        """One engine step: metadata to every worker, results aggregated as vLLM's
        KVOutputAggregator does (finished once every worker reported it)."""
        assert self.scheduler is not None
        meta = self.scheduler.call({"op": "meta"})["meta"]
        for w in self.workers:
            w.send({"op": "step", "meta": meta})
        sending: set[str] = set()
        recving: set[str] = set()
        for w in self.workers:
            a = w._answer()
            self.invalid.update(a["invalid"])
            for rid in a["sending"]:
                self._sending[rid] = self._sending.get(rid, 0) + 1
                if self._sending[rid] == self.tp:
                    sending.add(rid)
            for rid in a["recving"]:
                self._recving[rid] = self._recving.get(rid, 0) + 1
                if self._recving[rid] == self.tp:
                    recving.add(rid)
        self.freed |= sending
        self.received |= recving
        self.scheduler.call({"op": "output", "sending": sorted(sending),
                             "recving": sorted(recving)})  # fmt: skip

    def stats(self) -> list[dict[str, Any]]:
        return [w.call({"op": "stats"}) for w in self.workers]

    def close(self) -> None:
        for w in self.workers:
            w.close()
        if self.scheduler is not None:
            self.scheduler.close()


class SchedulerEngine:
    """A vLLM engine in one forked process (interop/vllm_engine.py): vLLM's real Scheduler
    and a TP-1 worker, its connector (``KVWireConnector`` or ``NixlConnector``) built by
    vLLM's KVConnectorFactory on both sides."""

    def __init__(
        self,
        role: str,
        connector: str,
        zygote: Zygote,
        *,
        geo: Geometry | None = None,
        extra_config: dict[str, Any] | None = None,
        lease: int = 30,
        mode: str = "pull",
        engine_id: str | None = None,
        port: int | None = None,
        scheduler: dict[str, int] | None = None,
        layout: str = "LBHNC",
        tp: int = 1,
        hma: bool | None = None,
        window: int = 0,
        chunk: int = 0,
        rswa: int = 0,
        ring: bool = False,
        mamba: int = 0,
        indexer: bool = False,
        host_buffer: bool = False,
        drafter: str = "",
        kernel_block: int = 0,
        layerwise: bool = False,
        prefix_caching: bool = True,
        kv_role: str = "",
        multimodal: bool = False,
        deepseek_v4: list[int] | None = None,
        v4_bf16: bool = False,
        v41: bool = False,
        qwen4exp: bool = False,
        glm5next: bool = False,
    ) -> None:
        """``engine_id`` and ``port``: a restarted engine keeps its predecessor's;
        ``scheduler``: ``batch_tokens`` (tokens per step) and ``chunk_tokens`` (per request
        per step), to make chunked prefills compete for blocks; ``layout``: vLLM's KV cache
        layout (the engine checks bytes only in LBHNC); ``tp``: workers in the engine, each
        with its share of the heads, finished by vLLM's output aggregator; ``hma``: vLLM's
        hybrid KV cache manager on or off (``None``: as vLLM resolves it); ``window``:
        every odd layer sliding-window attention over that many tokens; ``chunk``: Llama
        4's interleaving, three layers of chunked local attention (chunks of that many
        tokens) then a full-attention one; ``rswa``: every layer R-SWA (vLLM's
        ``RSWASpec``) over a decode window of that many tokens; ``ring``: every odd layer
        a ring of the latest tokens' keys (vLLM's ``CircularBufferSpec``, one block a
        request, its capacity the block size); ``mamba``: after
        each attention layer that many Mamba2 layers; ``indexer`` (an MLA model): each
        layer also holds DeepSeek-V3.2's indexer keys (sparse MLA); ``host_buffer``: a
        kvwire engine stages its KV through a host copy as on a device platform with
        ``kv_buffer_device: "cpu"`` (the CPU cache stands for the device's); ``drafter``:
        speculative decoding, ``method:tokens`` (``eagle:1``, ``mtp:3``), the last layer
        the drafter's; ``kernel_block``:
        the attention backend runs only kernel blocks of that many tokens (vLLM splits each
        block into several); ``layerwise``: P computes each step's chunk layer by layer,
        each layer's share written just before its ``save_kv_layer`` (for streaming);
        ``prefix_caching``: vLLM's (off: a preempted prompt is computed again from its
        first token, into whatever blocks it gets); ``kv_role``: vLLM's, when not the
        ``role``'s own (``kv_both``: the engine is P for requests added with
        ``do_remote_decode``, D for those with ``do_remote_prefill``); ``multimodal``: the
        model takes images (vLLM's scheduler schedules their encoding; see ``add``);
        ``deepseek_v4``: DeepSeek-V4's caches, a layer per compress ratio given (vLLM's own
        modules, grouping and allocation; ``geo`` of 256-token blocks, ``layout`` BLHNC or
        BLNHC), each group's pages filled and checked whole; ``v4_bf16``: its caches in
        bf16 rather than the ``fp8_ds_mla`` V4 resolves to on CPU and FlashMLA;
        ``qwen4exp``: Qwen4Exp's caches over ``geo``'s layers (vLLM's own classes,
        alignment, grouping and allocation; ``layout`` BLHNC or BLNHC), each page filled and
        checked whole, each TP rank's its own; ``glm5next``: Glm5Next's caches likewise
        (``layout`` the one its indexer's tail takes: BLHNC in vLLM 0.32.0, LBHNC in
        0.31.0, whose latents vLLM splits into kernel blocks)."""
        self.role = role
        self.tp = tp
        extra_config = dict(extra_config or {})
        if connector == "KVWireConnector":
            extra_config["transfer_mode"] = mode
        elif mode == "push":
            connector = "NixlPushConnector"
        self.geo = geo or Geometry()
        self.engine_id = engine_id or f"{connector}-{role}-{os.getpid()}-{free_port()}"
        self.port = port or free_port()
        env = {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.port),
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo"),
            # Mamba's conv state dim-first: stock's transfer refuses any other layout.
            "VLLM_SSM_CONV_STATE_LAYOUT": "DS",
        }
        start = {
            "part": "engine", "role": role, "connector": connector,
            "engine_id": self.engine_id, "tp_size": tp, "model": self.geo.model,
            "layers": self.geo.layers, "num_blocks": self.geo.num_blocks,
            "block_size": self.geo.block_size, "kv_heads": self.geo.kv_heads, "lease": lease,
            "hma": hma, "window": window, "chunk": chunk, "rswa": rswa, "mamba": mamba,
            "ring": ring, "indexer": indexer,
            "host_buffer": host_buffer, "drafter": drafter,
            "mode": mode, "extra_config": extra_config, "layout": layout,
            "kernel_block": kernel_block, "layerwise": layerwise, "prefix_caching": prefix_caching,
            "kv_role": kv_role, "multimodal": multimodal, "deepseek_v4": deepseek_v4,
            "bf16": v4_bf16, "v41": v41, "qwen4exp": qwen4exp,
            "glm5next": glm5next, **(scheduler or {}),
        }  # fmt: skip
        self.peer = Peer(start, zygote, env)
        self.state: dict[str, Any] = {}

    def add(
        self,
        rid: str,
        index: int,
        num_tokens: int,
        params: dict[str, Any] | None = None,
        images: list[tuple[int, int]] | None = None,
        max_tokens: int = 1,
        generated_from: int = 0,
    ) -> None:
        """``images``: an image's placeholder tokens per ``(offset, length)`` (a
        ``multimodal`` engine); ``max_tokens``: the tokens to generate (a decode engine
        writes the KV of those it computes, with content of their own); ``generated_from``:
        a prefill engine reading back a conversation expects that content from this token
        on (where the earlier turn's generated tokens start)."""
        self.peer.call({"op": "add", "rid": rid, "index": index, "num_tokens": num_tokens,
                        "params": params or {}, "images": images or [],
                        "max_tokens": max_tokens, "generated_from": generated_from})  # fmt: skip

    def abort(self, rid: str) -> None:
        self.peer.call({"op": "abort", "rid": rid})

    def step(self, n: int = 1) -> dict[str, Any]:
        self.state = self.peer.call({"op": "step", "n": n})
        return self.state

    def scribble_free(self) -> int:
        """Overwrite the free blocks that cache no prefix (what a later request computed
        into them); how many there were."""
        return int(self.peer.call({"op": "scribble_free"})["scribbled"])

    def pending_registrations(self) -> list[int]:
        """P (kvwire): per rank, D's push registrations not yet matched with a prompt."""
        return list(self.peer.call({"op": "registrations"})["pending"])

    def machine_stats(self) -> list[dict[str, int]]:
        """kvwire: per rank, its transfer machine's counters."""
        return [rank["machine"] for rank in self.peer.call({"op": "debug"})["ranks"]]

    def close(self) -> None:
        self.peer.close()


def kvwire_options(
    role: str,
    mode: str,
    tp: int,
    geo: Geometry,
    *,
    lease: float = 30.0,
    rank_extra: dict[str, Any] | None = None,
) -> EngineOptions:
    return EngineOptions(
        model=geo.model,
        layers=geo.layers,
        tp=tp,
        num_blocks=geo.num_blocks,
        mode=mode,
        transport="nixl",
        engine_id=f"kvwire-{role}-{os.getpid()}-{free_port()}",
        lease_s=lease,
        block_tokens=geo.block_size,
        rank_extra=rank_extra or {},
    )


def vllm_compatible_extra(geo: Geometry, mode: str, names: list[str]) -> dict[str, Any]:
    """What a kvwire engine must say to match a vLLM CPU engine of this model (this
    suite's release): vLLM's layout name, its layer names as region names, its backend,
    protocol version and hash factors."""
    m = preset(geo.model)
    backend = "CPU_MLA" if m.mla else "CPU_ATTN"
    extra: dict[str, Any] = {
        "layout": "LBHNC",
        "region_names": names,
        "attn_backend": backend,
        "compat": factors(geo, mode, backend=backend),
        "version": PROTOCOL_VERSION,
    }
    if mode == "push":
        # vLLM's agents keep UCX's peer error handling; in push mode both sides open an
        # endpoint to the other, which a kvwire agent in its default mode (none) cannot.
        extra["transport_options"] = {"backend_options": {"ucx_error_handling_mode": "peer"}}
    return extra


def wait_until(
    cond: Callable[[], bool], step: Callable[[], None], timeout: float, what: str
) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        step()
        time.sleep(0.005)


def prefill(
    p: SchedulerEngine, rid: str, index: int, tokens: int, max_tokens: int = 1
) -> dict[str, Any]:
    """P prefills ``rid`` to its end (``max_tokens`` above 1: it generates past the
    prompt); its params for D."""
    p.add(rid, index, tokens, max_tokens=max_tokens)
    wait_until(lambda: rid in p.state.get("outputs", {}), p.step, 30, f"P to finish {rid}")
    return dict(p.state["outputs"][rid])


def step_both(
    p: SchedulerEngine, d: SchedulerEngine, done: Callable[[], bool], what: str, timeout: float = 60
) -> None:
    """D then P step, over and over, until ``done``."""

    def both() -> None:
        d.step()
        p.step()

    wait_until(done, both, timeout, what)


def load_refused(
    p: SchedulerEngine, d: SchedulerEngine, rid: str, index: int, tokens: int,
    params: dict[str, Any],
) -> list[str]:  # fmt: skip
    """D is given P's ``params`` for ``rid`` and fails the request without reading any of
    it, and P frees its blocks: D's log, which says why."""
    d.add(rid, index, tokens, params)
    step_both(
        p, d,
        lambda: rid in d.state.get("outputs", {}) and rid in p.state["sent"],
        "D to fail the request and P to free its blocks",
    )  # fmt: skip
    assert d.state["failed"] == [rid] and rid not in d.state["checked"]
    return list(d.peer.log)


def transfer(
    p: SchedulerEngine, d: SchedulerEngine, rid: str, index: int, tokens: int
) -> dict[str, Any]:
    """P prefills; its params go to D (as a proxy forwards them); both engines step until D
    has the KV and P has its blocks back."""
    p.add(rid, index, tokens)
    wait_until(lambda: rid in p.state.get("outputs", {}), p.step, 30, f"P to finish {rid}")
    params = p.state["outputs"][rid]
    assert params["do_remote_prefill"] and params["remote_request_id"] == rid
    d.add(rid, index, tokens, params)
    return moved(p, d, rid)


def moved(p: SchedulerEngine, d: SchedulerEngine, rid: str) -> dict[str, Any]:
    """Both engines step until D has ``rid``'s KV and P has its blocks back; D's state."""

    def both() -> None:
        d.step()
        p.step()

    try:
        wait_until(
            lambda: rid in d.state.get("outputs", {}) and rid in p.state.get("sent", []),
            both, 30, f"D to finish {rid} and P to free it",
        )  # fmt: skip
    except TimeoutError as exc:
        raise TimeoutError(
            f"{exc}; D: {d.peer.call({'op': 'stats'})}, {d.peer.log[-3:]}; "
            f"P: {p.peer.call({'op': 'stats'})}, {p.peer.log[-3:]}"
        ) from None
    return d.state


def params_ahead(p: SchedulerEngine, rid: str) -> dict[str, Any]:
    """Push: what a proxy that knows P's address can give D with the request before P has
    computed anything. D registers its blocks with P from it; P's block ids, which P's own
    params add, are P's to plan by in push mode."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [],
        "remote_engine_id": p.engine_id, "remote_request_id": rid,
        "remote_host": "127.0.0.1", "remote_port": p.port,
        "tp_size": p.tp, "pp_size": 1, "dcp_size": 1, "transfer_mode": "push",
    }  # fmt: skip


def streamed(
    p: SchedulerEngine, d: SchedulerEngine, rid: str, index: int, tokens: int
) -> dict[str, Any]:
    """Push, D first: D gets the request (and registers its blocks with P) before P has
    stepped it, so P's runtime may write the prompt while P computes it; then both engines
    step until D has the KV and P has its blocks back. Returns D's state."""
    p.add(rid, index, tokens)  # queued: P has not scheduled it
    d.add(rid, index, tokens, params_ahead(p, rid))
    wait_until(lambda: min(p.pending_registrations()) > 0, d.step, 30, f"D's registration of {rid}")
    return moved(p, d, rid)


def transfer_many(
    p: SchedulerEngine, d: SchedulerEngine, index: int, prompts: dict[str, int]
) -> dict[str, Any]:
    """P prefills every prompt (one content: a later one may hit an earlier one's cached
    blocks) and holds them all at once; then D fetches them all, as a proxy forwards P's
    params, and both step until D has every request and P has freed them."""
    for rid, tokens in prompts.items():
        p.add(rid, index, tokens)
        wait_until(lambda r=rid: r in p.state.get("outputs", {}), p.step, 30, f"P: {rid}")
    for rid, tokens in prompts.items():
        d.add(rid, index, tokens, p.state["outputs"][rid])

    def both() -> None:
        d.step()
        p.step()

    def done() -> bool:
        return set(prompts) <= set(d.state.get("outputs", {})) & set(p.state.get("sent", []))

    wait_until(done, both, 60, f"D to receive {sorted(prompts)} and P to free them")
    return d.state


__all__ = [
    "BLOCK",
    "PAIRS",
    "DecodeEngine",
    "Geometry",
    "PrefillEngine",
    "VllmEngine",
    "Zygote",
    "factors",
    "held_bytes",
    "kvwire_options",
    "load_refused",
    "move_all",
    "pair_cases",
    "pair_moved",
    "pair_transfer",
    "params_ahead",
    "prefill",
    "step_both",
    "streamed",
    "transfer",
    "registered_by_each",
    "transfer_many",
    "vllm_compatible_extra",
    "wait_until",
]


PAIRS = {
    "kvwire-shm": ("KVWireConnector", "KVWireConnector", "shm"),
    "kvwire-nixl": ("KVWireConnector", "KVWireConnector", "nixl"),
    "stock-P-kvwire-D": ("NixlConnector", "KVWireConnector", "nixl"),
    "kvwire-P-stock-D": ("KVWireConnector", "NixlConnector", "nixl"),
}
"""A model's pairs: (P's connector, D's connector, kvwire's transport), by name."""


def held_bytes(groups: list[tuple[int, int, list[int]]], tokens: int) -> int:
    """Bytes of the pages D must hold after a prompt of ``tokens``: per group, every
    block of the prompt, or with a window those from the one holding token
    ``tokens - window + 1`` on, each block a page per layer, the last block's pages their
    share of the prompt's tokens in it."""
    total = 0
    for block, window, pages in groups:
        first = max(0, tokens - window + 1) // block if window else 0
        last = -(-tokens // block) - 1
        total += (last - first) * sum(pages)
        total += sum(page * (tokens - last * block) // block for page in pages)
    return total


def move_all(
    p: SchedulerEngine, d: SchedulerEngine, prompts: dict[str, tuple[int, int]]
) -> dict[str, Any]:
    """P prefills every prompt, each of its own content, and holds them all at once; then
    D fetches them all, as a proxy forwards P's params, and both step until D has every
    request and P has freed them. D's state."""
    for rid, (index, tokens) in prompts.items():
        p.add(rid, index, tokens)
        wait_until(lambda r=rid: r in p.state.get("outputs", {}), p.step, 60, f"P: {rid}")
    for rid, (index, tokens) in prompts.items():
        d.add(rid, index, tokens, p.state["outputs"][rid])

    def done() -> bool:
        return set(prompts) <= set(d.state.get("outputs", {})) & set(p.state.get("sent", []))

    step_both(p, d, done, f"D to receive {sorted(prompts)} and P to free them", 120)
    return d.state


def pair_cases() -> list[tuple[str, str, str]]:
    """(pair, TP sizes ``P-D``, mode) for every pair of :data:`PAIRS`: the unequal TP
    sizes over NIXL (the shared-memory loopback is one host's TP 1-1), pull and push."""
    return [
        (pair, tp, mode)
        for pair in sorted(PAIRS)
        for tp in (["1-1"] if pair == "kvwire-shm" else ["1-1", "1-2", "2-1"])
        for mode in ("pull", "push")
    ]


def pair_moved(
    zygote: Zygote, pair: str, tp: str, mode: str, prompts: dict[str, tuple[int, int]],
    **options: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """:func:`move_all` between the engines of one of :data:`PAIRS` at TP sizes ``P-D``,
    on vLLM's hybrid manager, each engine with ``options``: D's state and P's outputs (the
    params)."""
    p_conn, d_conn, transport = PAIRS[pair]
    p_tp, d_tp = (int(n) for n in tp.split("-"))
    with engines(
        zygote, p_conn, d_conn, {"tp": p_tp}, {"tp": d_tp}, mode=mode,
        extra_config={"transport": transport}, **{"hma": True, **options},
    ) as (p, d):  # fmt: skip
        state = move_all(p, d, prompts)
        return state, dict(p.state["outputs"])


def pair_transfer(
    zygote: Zygote, pair: str, tp: str, mode: str, index: int, prompts: dict[str, int],
    **options: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """:func:`pair_moved` of prompts of one content ``index`` (a later one may hit an
    earlier one's blocks in P's prefix cache)."""
    contents = {rid: (index, tokens) for rid, tokens in prompts.items()}
    return pair_moved(zygote, pair, tp, mode, contents, **options)


@contextlib.contextmanager
def engines(
    zygote: Zygote,
    p_connector: str,
    d_connector: str,
    p_options: dict[str, Any] | None = None,
    d_options: dict[str, Any] | None = None,
    **options: Any,
) -> Iterator[tuple[SchedulerEngine, SchedulerEngine]]:
    """A P and a D engine with ``options`` (each side's own over them), closed on the way
    out whatever happened."""
    p = SchedulerEngine("P", p_connector, zygote, **{**options, **(p_options or {})})
    try:
        d = SchedulerEngine("D", d_connector, zygote, **{**options, **(d_options or {})})
        try:
            yield p, d
        finally:
            d.close()
    finally:
        p.close()


def registered_by_each(zygote: Zygote, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(stock's, kvwire's) answer to ``regions`` from a P engine of each connector over the
    same ``options``: the regions, names, groups and block facts each registers and
    advertises, which a mixed pair must agree on region for region."""
    found = []
    for connector in ("NixlConnector", "KVWireConnector"):
        engine = SchedulerEngine("P", connector, zygote, **options)
        try:
            found.append(engine.peer.call({"op": "regions"}))
        finally:
            engine.close()
    return found[0], found[1]


def assert_moved(p: SchedulerEngine, d: SchedulerEngine, rid: str, index: int, tokens: int) -> int:
    """One request from P to D, its bytes checked on D with none wrong: how many bytes
    D's ranks checked."""
    state = transfer(p, d, rid, index, tokens)
    assert rid in state["checked"], (state["invalid"], d.peer.log[-3:], p.peer.log[-3:])
    wrong, checked = state["checked"][rid]
    assert checked > 0 and wrong == 0, (wrong, checked)
    return int(checked)
