"""Benchmark suites for ``kvwire bench``; one module per suite, each ``run(opts) -> Report``."""
