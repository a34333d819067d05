"""A progress thread that keeps an agent answering without spinning a core.

With NIXL's own progress thread off, an agent's UCX worker moves only while someone calls
into the agent. A target that is busy elsewhere then stalls its peers: notifications pile
up in the shared-memory FIFO until the sender's transfers stop completing (seen here after
a few hundred unread notifications), and transports that emulate one-sided operations
(TCP) need the target's worker to serve them. NIXL's own thread fixes that by spinning,
which costs a core per agent and halved bandwidth on a 2-core machine.

This thread instead calls the progress function with exponential backoff: right after
activity it comes back within ``min_s``, and each idle round doubles the pause up to
``max_s``. When the owner has progressed the agent itself within the current pause (it is
polling anyway), the thread skips its turn, so a busy caller and the thread do not fight
over the agent's lock. When the owner has only *posted* since the last round (transfers
that finish inside the post, as small ones do here, are never polled), the thread skips up
to ``POST_SKIPS`` turns in a row, then runs one: a caller that posts back to back is not
interrupted every millisecond (that cost kvwire 3-10 % of its 64 KiB bandwidth against
raw NIXL on a loaded 2-core machine), yet its notifications are still fetched every
few milliseconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

POST_SKIPS = 3


class ProgressThread:
    def __init__(
        self,
        name: str,
        progress: Callable[[], bool],
        last_progress: Callable[[], float],
        *,
        min_s: float,
        max_s: float,
        posts: Callable[[], int] = lambda: 0,
    ) -> None:
        """``progress()`` moves the agent once and says whether anything happened;
        ``last_progress()`` is the monotonic time the owner last progressed it;
        ``posts()`` counts the owner's posts so far (read, never written, by the thread)."""
        self._progress = progress
        self._last_progress = last_progress
        self._posts = posts
        self._min_s = min_s
        self._max_s = max_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvwire-nixl-progress-{name}")
        self._thread.daemon = True
        self.rounds = 0
        self.skipped = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        pause = self._min_s
        seen_posts, post_skips = self._posts(), 0
        while not self._stop.wait(pause):
            if time.monotonic() - self._last_progress() < pause:
                self.skipped += 1  # the owner is progressing it: not needed for now
                pause = min(pause * 2, self._max_s)
                continue
            posts = self._posts()
            if posts != seen_posts and post_skips < POST_SKIPS:
                seen_posts, post_skips = posts, post_skips + 1
                self.skipped += 1  # the owner is busy posting: come back a little later
                pause = min(pause * 2, self._max_s)
                continue
            seen_posts, post_skips = posts, 0
            self.rounds += 1
            try:
                active = self._progress()
            except Exception:  # the owner reports errors on its own calls; keep serving
                active = False
            pause = self._min_s if active else min(pause * 2, self._max_s)
