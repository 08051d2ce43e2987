"""What a run records of itself, and reading it back.

``metrics`` (what each step reports: console, JSONL, TensorBoard, provenance writer),
``profiling`` (traces and memory views of a few steps), ``provenance`` (which tokens of
which documents trained each step, checked for exactly once) and ``runs`` (strict readers
of a run's per-step records, for tools and tests).

Never: change what a step trains on: it only reports and reads back.
"""
