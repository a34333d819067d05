"""kvwire's shared-memory loopback transport: real bytes between processes of one host.

``ShmTransport(name, **options)`` is the factory the ``kvwire.transports`` entry point
``shm`` names; :func:`allocate` gives host memory a peer maps directly (the syscall-free
path). Any other registered host memory is reached with cross-memory attach.
"""

from kvwire_shm._segments import allocate
from kvwire_shm.transport import ShmTransport

__all__ = ["ShmTransport", "allocate"]
