"""One module per ``kvwire`` subcommand: ``add_arguments(parser)`` and ``run(args) -> int``.

Every command takes its knobs from the one :class:`~kvwire.config.KVWireConfig`: a flag
given on the command line is its explicit layer (flags default to ``None`` so that an
absent flag lets ``KVWIRE_*`` variables and the ``--config`` file speak).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvwire.config import KVWireConfig


def load_config(args: argparse.Namespace, **flags: Any) -> KVWireConfig:
    """The configuration of this command: ``flags`` that were given (not None) over the
    environment over ``--config`` / ``$KVWIRE_CONFIG`` over the defaults."""
    from kvwire.config import KNOBS, KVWireConfig
    from kvwire.errors import ConfigError

    given: dict[str, Any] = {}
    for name, value in flags.items():
        if value is None:
            continue
        try:  # parsed here so that the message names the flag the user typed
            given[name] = KNOBS[name].parse(value)
        except (ValueError, TypeError) as exc:
            flag = FLAGS.get(name, "--" + name.replace("_", "-"))
            raise ConfigError(f"{flag} {value!r}: {exc}") from None
    return KVWireConfig(config_file=getattr(args, "config", None), **given)


FLAGS = {
    "lease_s": "--lease",
    "handshake_timeout_s": "--timeout",
    "handshake_retries": "--retries",
    "version": "--version",
    "metadata_store": "--store",
}
"""Configuration fields whose flag is not ``--`` plus the field's name."""
