"""The handshake secret: read from a file an operator controls, checked, never shown.

Configuration reads it (``secret_file``) and the side channel's authentication derives its
keys from it, so the rules for a usable secret live here, below both.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from kvwire.errors import ConfigError

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096

log = logging.getLogger("kvwire.auth")


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """The shared secret in ``path`` (trailing newlines dropped), checked but never shown.

    A file others can read is refused: anyone who reads it can fetch every engine's memory
    keys. A group-readable one is accepted with a warning (a deployment may share it with a
    service group on purpose).
    """
    where = os.fspath(path)
    try:
        info = os.stat(where)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"secret file {where} is not a regular file")
        if info.st_mode & stat.S_IROTH:
            raise ConfigError(
                f"secret file {where} is readable by every user; run `chmod 600 {where}`"
            )
        if info.st_mode & stat.S_IRGRP:
            log.warning("secret file %s is readable by its group", where)
        if info.st_size > MAX_SECRET_BYTES + 2:
            raise ConfigError(f"secret file {where} is larger than {MAX_SECRET_BYTES} bytes")
        data = Path(where).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read secret file {where}: {exc.strerror or exc}") from None
    return check_secret(data.rstrip(b"\r\n"), where)


def check_secret(secret: bytes, where: str = "the secret") -> bytes:
    if not isinstance(secret, bytes):
        raise ConfigError("a handshake secret must be bytes")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{where} holds {len(secret)} bytes; a handshake secret needs at least "
            f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    if len(secret) > MAX_SECRET_BYTES:
        raise ConfigError(f"{where} is longer than {MAX_SECRET_BYTES} bytes")
    return secret
