"""kvwire transport conformance suite."""
