"""Which ranks talk to which, and how many completion notifications close a request.

Pure integer functions of TP/PP sizes and ranks; the state machine calls them with the
numbers it learned from ``kv_transfer_params`` and the handshake.

Vocabulary: the *consumer* (D) receives KV, the *producer* (P) holds it. In pull mode the
consumer posts READs; in push mode the producer posts WRITEs. Rank selection is always
decided from the consumer's point of view, so both modes move the same bytes between the
same pairs of ranks.
"""

from __future__ import annotations

from functools import lru_cache

from kvwire.errors import ConfigError


def _check_sizes(local_tp: int, remote_tp: int) -> None:
    if local_tp <= 0 or remote_tp <= 0:
        raise ConfigError(f"TP sizes must be positive, got {local_tp} and {remote_tp}")
    if max(local_tp, remote_tp) % min(local_tp, remote_tp):
        raise ConfigError(f"TP sizes {local_tp} and {remote_tp} must divide one another")


def tp_ratio(local_tp: int, remote_tp: int) -> int:
    """``local // remote`` when local >= remote, else ``-(remote // local)`` (vLLM's sign)."""
    _check_sizes(local_tp, remote_tp)
    if local_tp >= remote_tp:
        return local_tp // remote_tp
    return -(remote_tp // local_tp)


def remote_tp_ranks(local_tp_rank: int, local_tp: int, remote_tp: int) -> list[int]:
    """The remote TP ranks a local rank handshakes with and notifies.

    A positive ratio maps several local ranks onto one remote rank; a negative one gives each
    local rank ``|ratio|`` consecutive remote ranks. Symmetric: it serves D looking at P and
    P looking at D alike.
    """
    ratio = tp_ratio(local_tp, remote_tp)
    if not 0 <= local_tp_rank < local_tp:
        raise ConfigError(f"tp_rank {local_tp_rank} is outside tp_size {local_tp}")
    if ratio > 0:
        return [local_tp_rank // ratio]
    width = -ratio
    return [local_tp_rank * width + i for i in range(width)]


def remote_ranks(
    local_tp_rank: int, local_tp: int, remote_tp: int, remote_pp: int = 1
) -> list[tuple[int, int]]:
    """``(pp_rank, tp_rank)`` of every remote worker a local rank talks to (pp-major)."""
    if remote_pp <= 0:
        raise ConfigError(f"pp_size must be positive, got {remote_pp}")
    tps = remote_tp_ranks(local_tp_rank, local_tp, remote_tp)
    return [(pp, tp) for pp in range(remote_pp) for tp in tps]


def head_range(tp_rank: int, tp_size: int, total_kv_heads: int) -> range:
    """Global KV head ids held by one TP rank, in storage order.

    With more ranks than heads every rank holds exactly one head (GQA replication), the
    head ``tp_rank * total // tp_size``; otherwise the heads are split evenly in order.
    """
    if tp_size >= total_kv_heads:
        head = tp_rank * total_kv_heads // tp_size
        return range(head, head + 1)
    per_rank = total_kv_heads // tp_size
    return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)


@lru_cache(maxsize=4096)
def head_sources(
    consumer_tp_rank: int, consumer_tp: int, producer_tp: int, total_kv_heads: int
) -> tuple[int, ...]:
    """For each KV head the consumer rank stores (in its storage order), the producer rank
    whose copy it receives.

    Among the producer ranks the consumer talks to, the first one holding a head wins; when
    several producer ranks hold the same head (producer TP > KV heads), the others send no
    data for it, only their completion notification.
    """
    if total_kv_heads <= 0:
        raise ConfigError(f"total_kv_heads must be positive, got {total_kv_heads}")
    peers = remote_tp_ranks(consumer_tp_rank, consumer_tp, producer_tp)
    sources = []
    for head in head_range(consumer_tp_rank, consumer_tp, total_kv_heads):
        holder = next(
            (p for p in peers if head in head_range(p, producer_tp, total_kv_heads)), None
        )
        if holder is None:
            raise ConfigError(
                f"no producer rank among {peers} holds KV head {head} "
                f"(consumer rank {consumer_tp_rank}/{consumer_tp}, producer TP {producer_tp}, "
                f"{total_kv_heads} heads)"
            )
        sources.append(holder)
    return tuple(sources)


def replicated_source(consumer_tp_rank: int, consumer_tp: int, producer_tp: int) -> int:
    """The one producer rank a consumer rank reads a replicated (MLA) region from."""
    return remote_tp_ranks(consumer_tp_rank, consumer_tp, producer_tp)[0]


def read_source_ranks(
    consumer_tp_rank: int,
    consumer_tp: int,
    producer_tp: int,
    total_kv_heads: int,
    *,
    is_mla: bool = False,
) -> list[int]:
    """Producer TP ranks that send data to this consumer rank (a subset of its peers).

    The other peers of :func:`remote_tp_ranks` get a notification only, so they can free.
    """
    if is_mla:
        return [replicated_source(consumer_tp_rank, consumer_tp, producer_tp)]
    sources = head_sources(consumer_tp_rank, consumer_tp, producer_tp, total_kv_heads)
    return sorted(set(sources))


def pull_completion_count(
    producer_tp: int, consumer_tp: int, producer_dcp: int = 1, consumer_dcp: int = 1
) -> int:
    """The count a consumer rank puts in its pull completion, ``f"{request_id}:{count}"``.

    It is how many consumer ranks read from (or notify) one producer rank, and the producer
    frees a request once it has heard from exactly that many. vLLM's D sends this number, and
    vLLM's P waits for the number it is sent, so both sides must compute it identically:
    ``max(1, consumer_tp // producer_tp)`` when the producer's cache is not DCP-sharded (with
    MLA and producer TP > consumer TP the consumer reads one rank and notifies the rest, once
    each). With a DCP-sharded producer every consumer rank of a replicated (DCP 1) consumer
    reads every shard, and a sharded consumer reads ``consumer_dcp // producer_dcp`` of them.
    """
    _check_sizes(producer_tp, consumer_tp)
    for name, dcp in (("producer", producer_dcp), ("consumer", consumer_dcp)):
        if isinstance(dcp, bool) or not isinstance(dcp, int) or dcp < 1:
            raise ConfigError(f"{name} dcp_size must be an int >= 1, got {dcp!r}")
    if producer_dcp > 1:
        return consumer_tp if consumer_dcp == 1 else max(1, consumer_dcp // producer_dcp)
    return max(1, consumer_tp // producer_tp)


def consumer_expected_notifications(
    producer_tp: int, consumer_tp: int, producer_pp: int = 1
) -> int:
    """Completion notifications a consumer rank waits for in push mode.

    Every producer pipeline stage writes, and ``producer_tp // consumer_tp`` producer ranks
    share a consumer rank when the producer has more ranks.
    """
    _check_sizes(producer_tp, consumer_tp)
    if producer_pp <= 0:
        raise ConfigError(f"pp_size must be positive, got {producer_pp}")
    return producer_pp * max(1, producer_tp // consumer_tp)


def notified_producer_ranks(consumer_tp_rank: int, consumer_tp: int, producer_tp: int) -> list[int]:
    """Producer TP ranks a consumer rank sends its completion notification to (pull)."""
    return remote_tp_ranks(consumer_tp_rank, consumer_tp, producer_tp)


def consumer_ranks_of_producer(
    producer_tp_rank: int, producer_tp: int, consumer_tp: int
) -> list[int]:
    """Consumer TP ranks a producer rank serves (writes to in push mode)."""
    return remote_tp_ranks(producer_tp_rank, producer_tp, consumer_tp)
