# minikv-stub: 07a624cf789a7a4f
"""Your exercises for the minikv course (lessons 07 and 08).

Each module holds stubs that raise ``NotImplementedError``; their docstrings state the contract
and give hints.  Implement them, then grade:

    make grade                      # every exercise, with a summary table
    python -m exercises.grade 2b    # only exercise 2b

Lessons 07 and 08 run the same graders cell by cell.  The reference implementations are in
``solutions/`` (same names): peek only after trying.  This package is generated from
``solutions/`` by ``python -m minikv.grading.make_exercises``.
"""
