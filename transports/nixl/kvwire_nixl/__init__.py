"""kvwire nixl transport (placeholder)."""
