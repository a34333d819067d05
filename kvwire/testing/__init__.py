"""Test doubles for engines and transport authors: never imported by kvwire's core.

:mod:`kvwire.testing.faulty_transport` wraps any transport and injects faults (drops,
duplicates, failed posts, DONE turned FAILED) for tests and drills.
"""
