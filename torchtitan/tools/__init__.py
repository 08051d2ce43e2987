"""The project's acceptance tools, each named as the script that runs it.

``deterministic_resume`` (``scripts/deterministic_resume.py``): a resumed run continues
bit for bit; ``check_provenance`` (``scripts/check_provenance.py``): every token once,
nothing skipped; ``gpu_check`` (``scripts/gpu_check.sh``): the GPU acceptance plan.

Owns: each tool's argument parsing, plan and verdict. Never: train in-process or import
``train.py``; a tool launches the product as a user does.
"""
