"""Fuzzing kvwire's decoders: the target table, seeds, and structure-aware mutations.

Shared by the bounded Hypothesis tests in ``tests/fuzz`` (part of ``make test``) and the
long-running harness ``fuzz/fuzz_decoders.py`` (``make fuzz``). Not part of the installed
package: it imports kvwire, never the reverse.
"""
