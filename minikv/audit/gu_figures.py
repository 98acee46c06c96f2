"""Gu et al.'s verdicts as shipped figures: what the course prints with or without their data.

Gu et al. (ICML 2025) released raw response times but no license, so minikv does not ship their
zip (:mod:`minikv.audit.gu_data`).  What it can ship are *facts computed from* that release: for
each (provider, model, sharing level), the sample counts, the strongest configuration's KS p-value
and AUC, and the verdict.  ``gu_figures.json`` beside this module holds them, with attribution.

Why ship figures at all?  Lesson 09 puts the authors' measurements beside the learner's own audit.
If the lesson recomputed them only when the zip is present, its committed output would depend on
what the machine happens to have, and a learner's clone (no zip) would fail strict nbval while CI
(which has a copy) passes.  So the lesson always prints the shipped figures, and
:func:`published_figures` re-derives them from the raw times whenever the zip *is* found and
raises if a single figure differs.  CI has the zip, so every CI run still checks the recomputation;
``python -m minikv.audit.gu_figures --write`` regenerates the file after a deliberate change.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from .gu import LEVELS, GuVerdict, find_gu_zip, gu_verdicts
from .gu_data import ATTRIBUTION, GU_COMMIT, GU_SHA256, sha256_of

FIGURES_PATH = Path(__file__).with_name("gu_figures.json")
#: p-values are compared with this relative tolerance: scipy's exact KS distribution may move in the
#: last digits between releases, which is no change of fact; the verdicts must match exactly.
P_REL_TOL = 1e-6


class GuFiguresMismatch(AssertionError):
    """The released data, recomputed, disagrees with the shipped figures (names the first row)."""


def derive_figures(verdicts: list[GuVerdict]) -> dict:
    """The shipped figures, computed from verdicts: one row per (provider, model, level).

    Each row keeps the configuration with the strongest evidence (smallest p), as lesson 09 prints
    it, so the file holds exactly what a reader sees and nothing of the raw samples.
    """
    rows = []
    for v in sorted(verdicts, key=lambda v: (LEVELS.index(v.level), v.best[1].p_value, v.provider, v.model)):
        run, res = v.best
        rows.append({"provider": v.provider, "model": v.model, "level": v.level,
                     "n_hit": res.n_hit, "n_miss": res.n_miss,
                     "prefix_fraction": run.prefix_fraction, "n_victim": run.n_victim,
                     "ks_p": res.p_value, "auc": round(res.auc, 6), "detected": v.detected,
                     "configurations": len(v.runs)})
    return {"source": ATTRIBUTION, "commit": GU_COMMIT, "zip_sha256": GU_SHA256,
            "providers": len({v.provider for v in verdicts}), "rows": rows}


def load_figures(path: Path = FIGURES_PATH) -> dict:
    """The shipped figures as committed (no recomputation)."""
    return json.loads(Path(path).read_text())


def compare(shipped: dict, derived: dict) -> list[str]:
    """Every difference between two figure sets, one line each (empty: they agree)."""
    out = []
    if shipped["providers"] != derived["providers"]:
        out.append(f"providers: shipped {shipped['providers']}, recomputed {derived['providers']}")
    key = lambda r: (r["provider"], r["model"], r["level"])  # noqa: E731 -- a sort/lookup key
    a, b = {key(r): r for r in shipped["rows"]}, {key(r): r for r in derived["rows"]}
    for k in sorted(a.keys() ^ b.keys()):
        out.append(f"{k}: only in the {'shipped' if k in a else 'recomputed'} figures")
    for k in sorted(a.keys() & b.keys()):
        for field, want in a[k].items():
            got = b[k].get(field)
            same = (math.isclose(want, got, rel_tol=P_REL_TOL) if field == "ks_p"
                    else math.isclose(want, got, abs_tol=1e-6) if field == "auc" else want == got)
            if not same:
                out.append(f"{k} {field}: shipped {want!r}, recomputed {got!r}")
    return out


def published_figures(zip_path: Path | None = None, path: Path = FIGURES_PATH) -> tuple[dict, bool]:
    """``(figures, recomputed)``: the shipped figures, checked against the raw data where present.

    With the zip found (``find_gu_zip``, or ``zip_path``), every figure is recomputed from the raw
    client times and a difference raises :class:`GuFiguresMismatch`; ``recomputed`` says whether
    that check ran.  The figures returned are the shipped ones either way, so what a caller prints
    cannot depend on the machine.
    """
    shipped = load_figures(path)
    zip_path = zip_path or find_gu_zip()
    if zip_path is None:
        return shipped, False
    if sha256_of(zip_path) != shipped["zip_sha256"]:
        raise GuFiguresMismatch(f"{zip_path} is not the release the figures were computed from "
                                f"(sha256 {sha256_of(zip_path)[:12]}..., expected {shipped['zip_sha256'][:12]}...)")
    diffs = compare(shipped, derive_figures(gu_verdicts(zip_path)))
    if diffs:
        raise GuFiguresMismatch(f"{len(diffs)} shipped figure(s) differ from the released data, first: {diffs[0]}")
    return shipped, True


def main(argv: list[str] | None = None) -> int:
    """``python -m minikv.audit.gu_figures [--write]``: check (default) or rewrite the shipped file."""
    argv = sys.argv[1:] if argv is None else argv
    zip_path = find_gu_zip()
    if zip_path is None:
        print("gu-audit-data.zip not found: run `make gu-data` first", file=sys.stderr)
        return 2
    if argv == ["--write"]:
        FIGURES_PATH.write_text(json.dumps(derive_figures(gu_verdicts(zip_path)), indent=1) + "\n")
        print(f"wrote {FIGURES_PATH}")
        return 0
    if argv:
        print(f"unknown arguments {argv!r}; usage: python -m minikv.audit.gu_figures [--write]", file=sys.stderr)
        return 2
    published_figures(zip_path)
    print(f"{FIGURES_PATH.name} matches {zip_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
