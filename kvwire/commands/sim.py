"""Not built yet."""

from __future__ import annotations

import argparse

from kvwire.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def run(args: argparse.Namespace) -> int:
    raise ConfigError("kvwire sim is not built yet")
