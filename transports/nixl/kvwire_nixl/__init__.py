"""kvwire's NIXL transport: the ``kvwire.transport`` interface over a NIXL agent.

Registered under the ``kvwire.transports`` entry point as ``nixl``. Importing this
package is cheap and works without NIXL installed; the binding (``nixl-cu12``, the
``nixl`` extra) is imported when a :class:`NixlTransport` is created, and its absence is
a :class:`kvwire.errors.TransportUnavailableError` that names the extra.
"""

from __future__ import annotations

from kvwire_nixl.transport import NixlRegistration, NixlTransport, NixlXfer

__all__ = ["NixlRegistration", "NixlTransport", "NixlXfer"]
