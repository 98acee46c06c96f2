"""``python -m minikv.bench``: see :mod:`minikv.bench` for the sections and their flags."""
from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
