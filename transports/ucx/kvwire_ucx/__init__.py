"""kvwire's ``ucx`` transport: one-sided READ/WRITE on UCP's RMA API, no NIXL in between.

``import kvwire_ucx`` is cheap: it loads no UCX library. The libucx wheel's ``libucp`` is
opened (through ctypes, see :mod:`kvwire_ucx._ucp`) when the first :class:`UcxTransport` is
created; without the ``ucx`` extra that raises
:class:`kvwire.errors.TransportUnavailableError`.
"""

from __future__ import annotations

from kvwire_ucx.transport import NOTIFY_AM_ID, UcxTransfer, UcxTransport

__all__ = ["NOTIFY_AM_ID", "UcxTransfer", "UcxTransport"]
