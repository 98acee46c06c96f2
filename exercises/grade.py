# GENERATED from solutions/grade.py by `python -m minikv.grading.make_exercises` (copied unchanged).
# Course maintainers: edit solutions/grade.py and regenerate; never edit this file by hand.
# minikv-stub: 1f4c757c00144b77
"""Grade every exercise of this package and print a summary table.

    make grade                      # grades exercises/ (python -m exercises.grade)
    python -m exercises.grade 2b 3  # only exercises 2b and 3a/3b
    python -m solutions.grade       # the reference solutions (what CI checks)

The exit status is 0 when every selected exercise passes and 1 otherwise.
"""
from __future__ import annotations

import sys

from minikv.grading.runner import main

if __name__ == "__main__":
    sys.exit(main(__package__ or "exercises", sys.argv[1:]))
