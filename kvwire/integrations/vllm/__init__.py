"""kvwire as a vLLM KV connector: ``KVWireConnector``, loaded by module path.

A vLLM deployment switches to it with one JSON change::

    --kv-transfer-config '{"kv_connector": "KVWireConnector",
      "kv_connector_module_path": "kvwire.integrations.vllm", "kv_role": "kv_producer"}'

vLLM builds the connector twice: once beside its scheduler (role SCHEDULER: decides which
requests hold or load KV and says so in each step's metadata; runs the engine's one
handshake listener) and once per worker (role WORKER: a :class:`~kvwire.runtime.Producer` on a
``kv_producer`` engine, a :class:`~kvwire.runtime.Consumer` on a ``kv_consumer`` one, over the
worker's KV tensors). Everything between
the steps — handshakes, READs or WRITEs, notifications, leases — is the runtime's; the
worker calls only feed it and drain what ended. Settings are one
:class:`~kvwire.config.KVWireConfig` built from vLLM's ``kv_transfer_config`` (see
docs/vllm.md for every ``kv_connector_extra_config`` key).

The ``kv_transfer_params`` in and out are vLLM's own, so a stock ``NixlConnector`` engine
on the other side interoperates (with the ``nixl`` transport and matching factors).

One module per part: ``connector`` (the class vLLM instantiates), ``scheduler`` and
``worker`` (its two sides), ``geometry`` (where a worker's blocks are, as stock registers
them), ``config`` (the engine's one KVWireConfig and compatibility factors) and ``messages``
(what the sides hand each other through vLLM). The package imports vLLM and torch; nothing
in kvwire's core imports it (extra ``vllm``).
"""

from kvwire.integrations.vllm.config import kvwire_config
from kvwire.integrations.vllm.connector import KVWireConnector
from kvwire.integrations.vllm.messages import KVWireHandshake, KVWireMetadata

__all__ = ["KVWireConnector", "KVWireHandshake", "KVWireMetadata", "kvwire_config"]
