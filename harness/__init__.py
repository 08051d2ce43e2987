"""What the tests (``test/``) and the benchmarks (``scripts/benchmarks/``) share, and
the product does not: jobs run to completion, counters of what a piece of work reads, a
simulated source, corpora written for a measurement, and the benchmarks' harness.

Never imported by ``torchtitan`` (``test/test_imports.py`` checks it): the product
stands without its test support. Importable from the repository's root (pytest's
``pythonpath``; ``scripts/benchmarks/_root.py`` for the benchmarks).
"""
