"""Runnable examples built on kvwire.

Nothing here is imported by ``import kvwire``: examples may need extras (the reference
engine needs torch), so each is imported explicitly, e.g. ``kvwire.examples.engine``.
"""
