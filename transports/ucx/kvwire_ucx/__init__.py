"""kvwire ucx transport (placeholder)."""
