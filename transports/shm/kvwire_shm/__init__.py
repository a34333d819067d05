"""kvwire shm transport (placeholder)."""
