"""Random P/D pairs end to end: real runtimes in two processes, checked token by token.

:mod:`~kvwire.pairs.oracle` says where every token of a sequence lives in a rank's KV cache
without kvwire's descriptor code; :mod:`~kvwire.pairs.worker` is one side's process;
:mod:`~kvwire.pairs.run` drives a pair and judges it; :mod:`~kvwire.pairs.cases` draws
pairs (Hypothesis). ``kvwire pairs`` and ``tests/runtime/test_pairs.py`` run them.
"""
