"""Known bugs, planted back on purpose, to prove the pair property test finds them.

``python -m kvwire.pairs.worker --plant NAME`` applies one of these to the worker's own
process before it builds a runtime. Each is a faithful copy of a bug kvwire once shipped, so a
passing property test with the plant absent and a failing one with it present shows the
test can see that bug:

* ``trim-by-count``: the machines cut the producer's list to the consumer's block *count*
  before planning (wrong whenever the two block sizes differ);
* ``lenient-ids``: the runtime's argument checks skipped, block ids converted the old way
  (a flat list read as one group per id, floats truncated, numeric strings parsed).

Tooling only: nothing in the library imports this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def _trim_by_count() -> None:
    from kvwire.layout.plan import PeerLayout

    real = PeerLayout.plan

    def plan(self: PeerLayout, local: Any, remote: Any, **kw: Any) -> Any:
        def tails(long: Any, short: Any) -> Any:
            pairs = zip(long, short, strict=True)
            return tuple(tuple(p[len(p) - len(c) :]) if len(c) else () for p, c in pairs)

        if self.mode == "pull":
            remote = tails(remote, local)
        else:
            local = tails(local, remote)
        return real(self, local, remote, **kw)

    PeerLayout.plan = plan  # type: ignore[method-assign,assignment]


def _lenient_ids() -> None:
    from kvwire.runtime import consumer, producer

    def lenient(value: Any, geometry: Any, *, name: str = "block_ids") -> Any:
        return tuple(
            tuple(np.asarray(group, dtype=np.int64).reshape(-1).tolist()) for group in value
        )

    def any_tokens(value: Any, held: int = 0) -> Any:
        return value

    for module in (producer, consumer):
        module.block_ids_arg = lenient  # type: ignore[attr-defined]
        module.num_tokens_arg = any_tokens  # type: ignore[attr-defined]


PLANTS: dict[str, Callable[[], None]] = {
    "trim-by-count": _trim_by_count,
    "lenient-ids": _lenient_ids,
}
