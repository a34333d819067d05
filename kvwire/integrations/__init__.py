"""Adapters that put kvwire inside a serving engine (each an optional extra; the core never
imports them)."""
