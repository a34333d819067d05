"""Notifications: after their transfer's data (built to lose the race if the transport
cheats), exactly once, without transfers both ways, and in order when claimed."""

from __future__ import annotations

import uuid

import numpy as np

from kvwire.peer import protocol as p
from kvwire.transport import XferState
from kvwire_conformance import memory
from kvwire_conformance.base import SuiteBase
from kvwire_conformance.capabilities import capability
from kvwire_conformance.link import Link, assert_bytes, peer_notifications, seed
from kvwire_conformance.memory import I64


class NotificationTests(SuiteBase):
    """What a peer may rely on when a notification arrives."""

    def _bulk(self, link: Link, alloc: str, tag: str, fine: bool) -> tuple[I64, I64, I64]:
        """Spans that take a while to move, so a too-early notification wins its race:
        24 x 1 MiB, or (``fine``) 128k x 64 B, where per-descriptor costs dominate."""
        lr, pr = link.local_regions[alloc], link.peer_regions[alloc]
        rng = np.random.default_rng(seed(tag))
        count, size = (128 << 10, 64) if fine else (24, 1 << 20)
        lengths = np.full(count, size, dtype=np.int64)
        return memory.place(rng, lr.nbytes, lengths), memory.place(rng, pr.nbytes, lengths), lengths

    @capability("notifications", "write", "dram")
    def test_write_notification_arrives_after_its_data(self, link: Link) -> None:
        for alloc in link.spec.allocators:
            lr, pr = link.local_regions[alloc], link.peer_regions[alloc]
            # Coarse spans for one allocator, fine for the next: each catches an early
            # notification (the peer checks at once), so one round per allocator does.
            for round_ in (link.spec.allocators.index(alloc),):
                loff, roff, lengths = self._bulk(link, alloc, f"wnotify{round_}", round_ % 2 == 1)
                src_seed = seed("wnotify-src", round_)
                lr.view[:] = memory.cached_pattern(src_seed, lr.nbytes)
                link.peer.fill(pr.addr, pr.nbytes, seed("wnotify-bg", round_))
                message = f"conformance:write-notify:{uuid.uuid4().hex}".encode()
                # The peer reads the last descriptors first: the ones a too-early
                # notification would beat.
                rev = slice(None, None, -1)
                remote = memory.descs(pr.addr, roff, lengths)
                link.peer.start(p.AwaitThenRead(message, remote[rev].tobytes(), self.timeout))
                handle = link.local.write(
                    link.peer_name, memory.descs(lr.addr, loff, lengths), remote, message
                )
                answer = link.peer.finish(self.timeout * 2)
                state = link.wait(handle)
                assert state is XferState.DONE, f"WRITE ended {state.name}"
                link.local.release(handle)
                assert answer["found"], "the WRITE's notification never reached the peer"
                expected = memory.gather(lr.view, loff[rev], lengths[rev])
                got = np.frombuffer(answer["data"], dtype=np.uint8)
                assert_bytes(
                    got,
                    expected,
                    np.cumsum(lengths[rev]) - lengths[rev],
                    lengths[rev],
                    f"[{alloc}] peer memory when the WRITE's notification arrived",
                )

    @capability("notifications", "read", "dram")
    def test_read_notification_arrives_after_its_data(self, link: Link) -> None:
        """The READ's target may reuse its memory once notified: the reader's bytes stay."""
        for alloc in link.spec.allocators:
            lr, pr = link.local_regions[alloc], link.peer_regions[alloc]
            # Coarse spans for one allocator, fine for the next: each catches an early
            # notification (the peer checks at once), so one round per allocator does.
            for round_ in (link.spec.allocators.index(alloc),):
                loff, roff, lengths = self._bulk(link, alloc, f"rnotify{round_}", round_ % 2 == 1)
                src_seed = seed("rnotify-src", round_)
                link.peer.fill(pr.addr, pr.nbytes, src_seed)
                message = f"conformance:read-notify:{uuid.uuid4().hex}".encode()
                link.peer.start(
                    p.AwaitThenFill(message, pr.addr, pr.nbytes, seed("over", round_), self.timeout)
                )
                handle = link.local.read(
                    link.peer_name,
                    memory.descs(lr.addr, loff, lengths),
                    memory.descs(pr.addr, roff, lengths),
                    message,
                )
                state = link.wait(handle)
                found = link.peer.finish(self.timeout * 2)
                assert state is XferState.DONE, f"READ ended {state.name}"
                assert found, "the READ's notification never reached the peer"
                got = memory.gather(lr.view, loff, lengths)
                link.local.release(handle)
                expected = memory.gather(memory.cached_pattern(src_seed, pr.nbytes), roff, lengths)
                assert_bytes(
                    got,
                    expected,
                    np.cumsum(lengths) - lengths,
                    lengths,
                    f"[{alloc}] READ data (the source was reused when its notification came)",
                )

    @capability("notifications", "read", "dram")
    def test_notifications_arrive_exactly_once(self, link: Link) -> None:
        lr, pr = link.local_regions["numpy"], link.peer_regions["numpy"]
        link.peer.drain()
        tag = uuid.uuid4().hex
        prefix = f"once:{tag}:".encode()
        expected: list[bytes] = []
        handles = []
        for i in range(20):
            message = prefix + f"xfer:{i}".encode()
            local = memory.descs(lr.addr, np.array([i * 8192]), np.array([4096]))
            remote = memory.descs(pr.addr, np.array([i * 8192 + 3]), np.array([4096]))
            handles.append(link.local.read(link.peer_name, local, remote, message))
            expected.append(message)
            message = prefix + f"plain:{i}".encode()
            link.local.notify(link.peer_name, message)
            expected.append(message)
        for handle in handles:
            assert link.wait(handle) is XferState.DONE
            link.local.release(handle)

        # Only this test's messages count: one from an earlier test may still arrive.
        def mine(message: bytes) -> bool:
            return message.startswith(prefix)

        got = peer_notifications(link.peer, mine, len(expected), self.timeout)
        marker = prefix + b"marker"
        link.local.notify(link.peer_name, marker)
        got += peer_notifications(link.peer, mine, 1, self.timeout, until=marker)
        messages = [m for _, m in got]
        assert marker in messages, "the marker notification never arrived"
        messages.remove(marker)
        assert sorted(messages) == sorted(expected), (
            f"expected each of {len(expected)} notifications once; "
            f"missing {sorted(set(expected) - set(messages))[:3]}, "
            f"extra {[m for m in set(messages) if messages.count(m) != 1 or m not in expected][:3]}"
        )
        assert {peer for peer, _ in got} == {link.local_name}, (
            "notifications named the wrong sender"
        )

    @capability("notifications")
    def test_notifications_without_transfers_both_ways(self, link: Link) -> None:
        link.peer.drain()
        link.local.drain_notifications()
        messages = [
            b"\x00binary\xff" + bytes(range(256)),
            b"x",
            b"k" * 4096,
            "\u00e9t\u00e9".encode(),
        ]
        for message in messages:
            link.local.notify(link.peer_name, message)

        # Only the messages sent here count: one from an earlier test may still arrive.
        def sent(message: bytes) -> bool:
            return message in messages

        got = peer_notifications(link.peer, sent, len(messages), self.timeout)
        assert sorted(m for _, m in got) == sorted(messages)
        assert {peer for peer, _ in got} == {link.local_name}
        for message in messages:
            link.peer.call(p.Notify(link.local_name, message))
        back = link.local_notifications(len(messages), sent)
        assert sorted(m for _, m in back) == sorted(messages)
        assert {peer for peer, _ in back} == {link.peer_name}, "wrong sender name on arrival"

    @capability("ordered_notifications", "notifications", "read", "dram")
    def test_notifications_keep_their_order(self, link: Link) -> None:
        lr, pr = link.local_regions["numpy"], link.peer_regions["numpy"]
        link.peer.drain()
        prefix = f"order:{uuid.uuid4().hex}:".encode()
        sent: list[bytes] = []
        for i in range(200):
            message = prefix + f"{i:04d}".encode()
            if i % 20 == 10:  # a completed transfer's notification sits among plain ones
                local = memory.descs(lr.addr, np.array([0]), np.array([4096]))
                remote = memory.descs(pr.addr, np.array([0]), np.array([4096]))
                handle = link.local.read(link.peer_name, local, remote, message)
                assert link.wait(handle) is XferState.DONE
                link.local.release(handle)
            else:
                link.local.notify(link.peer_name, message)
            sent.append(message)
        # The order among this test's messages: one from an earlier test may still arrive.
        got = [
            m
            for _, m in peer_notifications(
                link.peer, lambda m: m.startswith(prefix), len(sent), self.timeout
            )
        ]
        assert got == sent, "notifications from one agent arrived out of order"
