"""Validate minikv's audit statistics on the data released by Gu et al. (ICML 2025).

Chenchen Gu, Xiang Lisa Li, Rohith Kuditipudi, Percy Liang and Tatsunori Hashimoto, "Auditing Prompt
Caching in Language Model APIs" (ICML 2025, arXiv:2502.07776), measured 17 API providers.  For every (provider, model, sharing level, prompt fraction, victim count) they
stored 250 "cache hit" and 250 "cache miss" client-side response times.  Re-deriving their
verdicts from the raw times is the strongest check that ``minikv.audit.stats`` uses the right
test, the right sidedness and the right significance level.

What the file fields mean (from the ``config``/``args`` blocks and the paper, Section 4):

* ``sharing_level`` -- who primed the cache ("victim") relative to who measured ("attacker"):
  ``per_user``: the same API key (is there *any* prompt caching?); ``per_org``: two users of the
  same organization; ``global``: two different organizations, i.e. a cache an arbitrary outsider
  can probe.  Only ``global`` sharing lets one customer learn about another customer's prompts.
* ``prefix_fraction`` -- the attacker's prompt shares this fraction of the victim's prompt as a
  prefix (1.0 = identical prompt; 0.95 = the last 5% differ, which shows that *prefix* matching,
  not whole-prompt memoisation, is what is cached).
* ``n_victim_requests`` (1, 5, 25) -- how many times the victim sent its prompt before the attacker
  measured.  Providers run many servers; repeating the victim prompt raises the chance that the
  attacker lands on a server holding the cache.

Verdict rule.  A (provider, model, level) is *detected* when ANY of its configurations (every
prompt fraction and every victim count present) rejects at alpha.  Each configuration is a valid
test of the same hypothesis "the cache is shared at this level", differing only in how hard it
tries to reach a warm server.  With at most six configurations per cell, a Bonferroni correction
would move the family-wise level from 1e-8 to at most 6e-8; ``bonferroni=True`` applies it and,
on the released data, changes nothing (the tests check this).

Every p-value here is recomputed from the raw ``client_time`` samples.  The files also carry a
``stats`` block with the authors' own statistics; this module never reads it (a test corrupts it
to prove so).

The data is the authors' (see :data:`minikv.audit.gu_data.ATTRIBUTION`); minikv does not ship it.
``minikv audit gu --fetch`` downloads it from their repository at a pinned commit and checks its
sha256 (:mod:`minikv.audit.gu_data`).
"""
from __future__ import annotations

import io
import json
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .gu_data import ZIP_NAME, cached_gu_zip
from .stats import GU_ALPHA, AuditResult, audit_samples

LEVELS = ("per_user", "per_org", "global")
LEVEL_MEANING = {
    "per_user": "same API key primes and measures (any prompt caching at all)",
    "per_org": "different users of the same organization",
    "global": "different organizations (cross-customer sharing)",
}


def find_gu_zip(start: str | os.PathLike | None = None) -> Path | None:
    """Locate ``gu-audit-data.zip``; return None when it is not available.

    Order: ``$MINIKV_SHARED`` (the shared folder, its ``data/`` folder, or the zip itself); then the
    copy ``minikv audit gu --fetch`` downloaded into ``$MINIKV_HOME/data/``; then ``shared/data/``
    in ``start`` (default: this package, then the working directory) or any of its parents.
    Walking up finds both a ``shared/`` inside the checkout and the CI layout where it sits next
    to the repo.  A set ``$MINIKV_SHARED`` replaces the walk: it names *the* shared folder, so
    pointing it at an empty one shows what a learner's clone, which has none, sees.
    """
    env = os.environ.get("MINIKV_SHARED")
    if env:
        p = Path(env)
        for cand in (p, p / ZIP_NAME, p / "data" / ZIP_NAME):
            if cand.is_file():
                return cand
    if cached_gu_zip().is_file():   # only a verified download is ever renamed into place
        return cached_gu_zip()
    if env:
        return None
    starts = [Path(start)] if start is not None else [Path(__file__).resolve().parent, Path.cwd()]
    for here in starts:  # the cwd covers a non-editable install run from the checkout
        for d in (here, *here.parents):
            cand = d / "shared" / "data" / ZIP_NAME
            if cand.is_file():
                return cand
    return None


@dataclass(frozen=True)
class GuRun:
    """One released measurement file: a configuration and its raw client times (seconds)."""

    provider: str
    model: str
    level: str
    endpoint: str
    prefix_fraction: float
    n_victim: int
    prompt_tokens: int
    member: str  # path inside the zip
    hit: tuple[float, ...]
    miss: tuple[float, ...]


def _client_times(samples: list, member: str, arm: str) -> tuple[float, ...]:
    out = []
    for i, s in enumerate(samples):
        t = s.get("client_time") if isinstance(s, dict) else None
        if not isinstance(t, (int, float)):
            raise ValueError(f"{member}: {arm}[{i}] has no numeric client_time")
        out.append(float(t))
    return tuple(out)


def parse_run(member: str, data: dict) -> GuRun:
    """Build a GuRun from one decoded file.  Reads ``config`` and the raw samples, never ``stats``."""
    cfg = data["config"]
    level = cfg["sharing_level"]
    folder = member.rstrip("/").split("/")[-2]
    if folder != level:  # the folder layout and the config must agree, or we misread the format
        raise ValueError(f"{member}: folder {folder!r} disagrees with sharing_level {level!r}")
    return GuRun(
        provider=cfg["provider"],
        model=cfg["model"],
        level=level,
        endpoint=cfg.get("endpoint", "?"),
        prefix_fraction=float(cfg["prefix_fraction"]),
        n_victim=int(cfg["n_victim_requests"]),
        prompt_tokens=int(cfg["n_prompt_tokens"]),
        member=member,
        hit=_client_times(data["cache_hit"], member, "cache_hit"),
        miss=_client_times(data["cache_miss"], member, "cache_miss"),
    )


def load_gu_runs(zip_path: str | os.PathLike | None = None) -> list[GuRun]:
    """Read every measurement straight from the zip (no extraction), sorted for stable output."""
    path = Path(zip_path) if zip_path is not None else find_gu_zip()
    if path is None or not Path(path).is_file():
        raise FileNotFoundError(
            f"{ZIP_NAME} not found (looked at {zip_path or '$MINIKV_SHARED, $MINIKV_HOME/data/ and shared/data/'}); "
            "run `minikv audit gu --fetch` (or `make gu-data`) to download it from the authors' repository"
        )
    runs = []
    with zipfile.ZipFile(path) as zf:
        for member in zf.namelist():
            if member.endswith(".json"):
                with zf.open(member) as fh:
                    runs.append(parse_run(member, json.load(io.TextIOWrapper(fh, "utf-8"))))
    if not runs:
        raise ValueError(f"{path}: no measurement files inside")
    return sorted(runs, key=lambda r: (r.provider, r.model, LEVELS.index(r.level) if r.level in LEVELS else 9,
                                       -r.prefix_fraction, r.n_victim, r.member))


@dataclass(frozen=True)
class GuVerdict:
    """Verdict for one (provider, model, level), with the per-configuration evidence."""

    provider: str
    model: str
    level: str
    detected: bool
    runs: tuple[tuple[GuRun, AuditResult], ...]

    @property
    def best(self) -> tuple[GuRun, AuditResult]:
        """The configuration with the smallest p-value (the strongest evidence)."""
        return min(self.runs, key=lambda ra: ra[1].p_value)


def gu_verdicts(zip_path: str | os.PathLike | None = None, alpha: float = GU_ALPHA,
                bonferroni: bool = False, runs: list[GuRun] | None = None) -> list[GuVerdict]:
    """Recompute every verdict from raw client times; one GuVerdict per (provider, model, level).

    ``bonferroni=True`` divides alpha by the number of configurations in the cell before applying
    the any-configuration rule.  Pass ``runs`` to reuse already loaded data.
    """
    runs = load_gu_runs(zip_path) if runs is None else runs
    cells: dict[tuple[str, str, str], list[GuRun]] = {}
    for r in runs:
        cells.setdefault((r.provider, r.model, r.level), []).append(r)
    out = []
    for (provider, model, level), rs in cells.items():
        a = alpha / len(rs) if bonferroni else alpha
        evidence = tuple((r, audit_samples(r.hit, r.miss, alpha=a)) for r in rs)
        out.append(GuVerdict(provider, model, level, any(res.detected for _, res in evidence), evidence))
    return out


def detected_providers(verdicts: list[GuVerdict], level: str = "global") -> set[str]:
    """Providers for which any model was detected at ``level``."""
    return {v.provider for v in verdicts if v.level == level and v.detected}


def gu_table(verdicts: list[GuVerdict], detail: bool = False) -> str:
    """Plain-text summary: one row per provider, one column per sharing level.

    Cells read ``YES``/``no`` (``-`` = level not measured), with the smallest p-value behind it.
    ``detail=True`` appends one line per configuration (model, fraction, victim count, p, AUC).
    """
    providers = sorted({v.provider for v in verdicts})
    by = {}
    for v in verdicts:
        by.setdefault((v.provider, v.level), []).append(v)

    def cell(p: str, level: str) -> str:
        vs = by.get((p, level))
        if not vs:
            return "-"
        best = min((v.best[1].p_value for v in vs))
        return f"{'YES' if any(v.detected for v in vs) else 'no '} p={best:.1e}"

    head = f"{'provider':<12}" + "".join(f"{lv:<18}" for lv in LEVELS)
    lines = [head, "-" * len(head)]
    for p in providers:
        lines.append(f"{p:<12}" + "".join(f"{cell(p, lv):<18}" for lv in LEVELS))
    glob = sorted(detected_providers(verdicts, "global"))
    lines.append("")
    lines.append(f"global (cross-organization) sharing detected in {len(glob)} of {len(providers)} "
                 f"providers: {', '.join(glob)}")
    if detail:
        lines.append("")
        lines.append(f"{'provider':<12}{'model':<44}{'level':<10}{'pf':>5}{'v':>4}{'n':>9}"
                     f"{'p-value':>11}{'AUC':>7}  verdict")
        for v in sorted(verdicts, key=lambda v: (v.provider, v.model, LEVELS.index(v.level))):
            for r, res in v.runs:
                lines.append(f"{r.provider:<12}{r.model[:43]:<44}{r.level:<10}{r.prefix_fraction:>5.2f}"
                             f"{r.n_victim:>4}{res.n_hit:>5}/{res.n_miss:<3}{res.p_value:>11.2e}"
                             f"{res.auc:>7.3f}  {'DETECTED' if res.detected else '-'}")
    return "\n".join(lines)
