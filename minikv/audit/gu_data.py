"""Gu et al.'s released timing data, for every learner: where it comes from and how it is fetched.

Gu, Li, Kuditipudi, Liang and Hashimoto ("Auditing Prompt Caching in Language Model APIs", ICML
2025) released the raw response times behind their verdicts in their repository,
``chenchenygu/auditing-prompt-caching``, as ``audit-data.zip``.  The repository has no license
file, so minikv does not redistribute the data: each learner downloads it from the authors.

Three things make that download trustworthy and repeatable:

* **Pinned commit.**  The URL names commit ``c96da85f...``, not a branch, so a later push to the
  repository cannot change what a learner gets.
* **Pinned content.**  The bytes must hash to :data:`GU_SHA256` (the copy CI keeps in
  ``shared/data/``).  The hash is computed while the bytes arrive; a mismatch deletes the partial
  file, so nothing unverified is ever left where :func:`minikv.audit.gu.find_gu_zip` looks.
* **Atomic placement.**  The download goes to ``<dest>.part`` and is renamed into place only after
  it verified, so an interrupted download cannot leave a truncated zip behind either.

``minikv audit gu --fetch`` and ``make gu-data`` call :func:`fetch_gu_data`; the file lands in
``$MINIKV_HOME/data/`` (:func:`cached_gu_zip`).  ``python -m minikv.audit.gu_data`` does the same.
"""
from __future__ import annotations

import hashlib
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

GU_REPO = "chenchenygu/auditing-prompt-caching"
GU_COMMIT = "c96da85f0e5ba9ae06258d4d8dbdf3ad831b22a2"
GU_FILE = "audit-data.zip"
GU_SHA256 = "6abcc89b389f1f2b1430cbad8276cef816c10fc87e3d96b4b056935ec43e6f6d"
# github.com/<repo>/raw/<commit>/<file> also follows Git LFS, should the file ever move there.
GU_URL = f"https://github.com/{GU_REPO}/raw/{GU_COMMIT}/{GU_FILE}"
ZIP_NAME = "gu-audit-data.zip"   # the name minikv stores it under (as in shared/data/)
ATTRIBUTION = (
    "Timing data: Chenchen Gu, Xiang Lisa Li, Rohith Kuditipudi, Percy Liang, Tatsunori Hashimoto, "
    "\"Auditing Prompt Caching in Language Model APIs\" (ICML 2025), released at "
    f"github.com/{GU_REPO} (commit {GU_COMMIT[:7]}). The repository has no license file: the data is "
    "downloaded for your own use and is not redistributed by minikv."
)
_CHUNK = 1 << 16


class GuDataError(RuntimeError):
    """The download failed or did not verify; the message says what to do next."""


def cached_gu_zip() -> Path:
    """Where a fetched copy lives: ``$MINIKV_HOME/data/gu-audit-data.zip`` (read on every call)."""
    from ..models.hub import minikv_home
    return minikv_home() / "data" / ZIP_NAME


def sha256_of(path: str | os.PathLike) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def fetch_gu_data(url: str = GU_URL, dest: str | os.PathLike | None = None, expected: str = GU_SHA256,
                  progress: bool = True, timeout: float = 60.0) -> Path:
    """Download ``url`` to ``dest`` (default :func:`cached_gu_zip`) and check its sha256.

    A ``dest`` that already holds the expected bytes is returned without any network access; one
    that holds anything else is deleted first.  Raises :class:`GuDataError` on a network error or a hash
    mismatch, leaving neither ``dest`` (if it was not already valid) nor a partial file behind.
    """
    dest = Path(dest) if dest is not None else cached_gu_zip()
    if dest.is_file():
        if sha256_of(dest) == expected:
            return dest
        dest.unlink()   # a corrupted or foreign copy must not stay where find_gu_zip looks
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        actual = _download(url, part, progress, timeout)
        if actual != expected:
            raise GuDataError(
                f"sha256 mismatch for {url}: expected {expected}, got {actual}. The download was "
                f"deleted and nothing was written to {dest}. Retry; if it repeats, the server is not "
                f"serving the authors' file at commit {GU_COMMIT[:7]}: do not use it.")
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
    return dest


def _download(url: str, part: Path, progress: bool, timeout: float) -> str:
    """Stream ``url`` into ``part`` behind a byte progress bar; return the sha256 of what arrived."""
    from tqdm.auto import tqdm
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp, open(part, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=ZIP_NAME, disable=not progress) as bar:
                for chunk in iter(lambda: resp.read(_CHUNK), b""):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    except (urllib.error.URLError, OSError) as exc:
        raise GuDataError(
            f"could not download {url}: {exc}. Offline? Copy {GU_FILE} from {GU_REPO} at commit "
            f"{GU_COMMIT[:7]} to {part.with_name(ZIP_NAME)}, or point $MINIKV_SHARED at a folder "
            f"holding {ZIP_NAME}.") from exc
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    """``python -m minikv.audit.gu_data [URL]``: fetch into the cache, print where and whose it is."""
    args = sys.argv[1:] if argv is None else argv
    try:
        path = fetch_gu_data(args[0] if args else GU_URL)
    except GuDataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{path} (sha256 verified)\n{ATTRIBUTION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
