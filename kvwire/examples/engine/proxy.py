"""The tiny proxy of disaggregated serving: prompt to P, ``kv_transfer_params`` to D, tokens
back from D.

It never touches KV: it only carries P's answer dict to D unchanged, exactly as vLLM's
toy proxy does, and times the three parts of time-to-first-token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvwire.examples.engine.process import EngineProcess, EngineProcessError


@dataclass
class Completion:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    failed: str | None = None
    prefill_s: float = 0.0
    """P's compute of the prompt."""
    transfer_s: float = 0.0
    """D: from handing kvwire the request to every rank holding the KV."""
    first_step_s: float = 0.0
    """D: the step that recomputes the last prompt token and yields the first token."""
    ttft_s: float = 0.0
    """Wall time at the proxy from sending the prompt to P to D's first token."""
    num_cached_on_d: int = 0
    p_first_token: int | None = None


class Proxy:
    def __init__(self, prefill: EngineProcess, decode: EngineProcess) -> None:
        self.prefill = prefill
        self.decode = decode

    def stream(self, out: Completion, prompt: Sequence[int], max_tokens: int) -> Iterator[int]:
        """Yield D's tokens as they arrive, filling ``out`` (timings, failure) on the way."""
        start = time.perf_counter()
        answer = self.prefill.call(
            {"op": "prefill", "request_id": out.request_id, "prompt": list(prompt)}
        )
        out.prefill_s = float(answer["prefill_s"])
        out.p_first_token = answer.get("first_token")
        command: dict[str, Any] = {
            "op": "decode",
            "request_id": out.request_id,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "kv_transfer_params": answer["kv_transfer_params"],
        }
        for event in self.decode.stream(command):
            kind = event.get("event")
            if kind == "token":
                if not out.tokens:
                    out.ttft_s = time.perf_counter() - start
                out.tokens.append(int(event["token"]))
                yield out.tokens[-1]
            elif kind == "done":
                out.transfer_s = float(event["transfer_s"])
                out.first_step_s = float(event["first_step_s"])
                out.num_cached_on_d = int(event["num_cached"])
            elif kind == "failed":
                out.failed = str(event.get("reason", "failed"))
            else:
                raise EngineProcessError(f"unexpected event from D: {event}")

    def complete(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> Completion:
        """Serve one request to the end."""
        out = Completion(request_id)
        for _ in self.stream(out, prompt, max_tokens):
            pass
        return out
