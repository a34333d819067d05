"""Logging with the context an operator greps for: engine, role, rank, transport, peer, request.

kvwire logs through the standard :mod:`logging` module under the ``kvwire`` logger
hierarchy (``kvwire.runtime``, ``kvwire.sidechannel.listener``, ``kvwire.config``) and never
configures handlers itself: the engine decides where records go. A line such as "handshake
failed" is useless in a fleet of hundreds of ranks unless it says *which* rank and *which*
peer, so every record from the runtime carries that context twice:

* as attributes of the :class:`logging.LogRecord` (``record.engine``, ``record.peer``, ...,
  and all of them as the dict ``record.kvwire``), for structured handlers such as
  :class:`JsonFormatter`;
* as a ``[engine=... peer=...]`` suffix of the message, so a plain ``%(message)s`` format
  shows it too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["CONTEXT_FIELDS", "ContextLogger", "JsonFormatter", "get_logger"]

CONTEXT_FIELDS = ("engine", "role", "rank", "transport", "peer", "request_id")
"""The context keys, in the order the message suffix lists them."""


class ContextLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A logger carrying fixed context; a call may add more with ``extra={...}``.

    ``extra`` of one call is merged over the bound context (not replacing it, as the
    standard adapter does), and keys whose value is ``None`` are left out.
    """

    def __init__(self, logger: logging.Logger, context: Mapping[str, Any]) -> None:
        super().__init__(logger, {k: v for k, v in context.items() if v is not None})

    @property
    def context(self) -> dict[str, Any]:
        return dict(self.extra or {})

    def bind(self, **context: Any) -> ContextLogger:
        """The same logger with more (or changed) context."""
        return ContextLogger(self.logger, {**self.context, **context})

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        """As the standard adapter, but the suffix is %-escaped only when ``args`` will be
        %-formatted into the message: a call without args is printed as written, and an
        escaped ``%`` (an IPv6 zone in a peer address) would show doubled."""
        if self.isEnabledFor(level):
            msg, options = self._with_context(msg, kwargs, escape=bool(args))
            options["stacklevel"] = options.get("stacklevel", 1) + 1  # report our caller
            self.logger.log(level, msg, *args, **options)

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        return self._with_context(msg, kwargs, escape=True)

    def _with_context(
        self, msg: Any, kwargs: MutableMapping[str, Any], *, escape: bool
    ) -> tuple[Any, MutableMapping[str, Any]]:
        call = kwargs.get("extra") or {}
        merged = {k: v for k, v in {**self.context, **call}.items() if v is not None}
        kwargs["extra"] = {**merged, "kvwire": merged}
        if merged:
            msg = f"{msg} [{_suffix(merged, escape=escape)}]"
        return msg, kwargs


def get_logger(name: str, **context: Any) -> ContextLogger:
    """``logging.getLogger(name)`` with context (see :data:`CONTEXT_FIELDS`) bound to it."""
    return ContextLogger(logging.getLogger(name), context)


def _suffix(context: Mapping[str, Any], *, escape: bool = False) -> str:
    ordered = [k for k in CONTEXT_FIELDS if k in context]
    ordered += sorted(k for k in context if k not in CONTEXT_FIELDS)
    text = " ".join(f"{k}={context[k]}" for k in ordered)
    # '%' would be read as a placeholder when the record is formatted with its args.
    return text.replace("%", "%%") if escape else text


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message and the kvwire context.

    The message is the record's message without the context suffix, which is given as
    fields instead.
    """

    def format(self, record: logging.LogRecord) -> str:
        context: dict[str, Any] = dict(getattr(record, "kvwire", {}) or {})
        message = record.getMessage()
        if context:
            suffix = f" [{_suffix(context)}]"
            message = message.removesuffix(suffix)
        out: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": message,
            **{k: _plain(v) for k, v in context.items()},
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)
