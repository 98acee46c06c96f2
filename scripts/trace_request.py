"""Print the files one request runs through, with their line counts: the engine's reading list.

    python scripts/trace_request.py            # the table
    python scripts/trace_request.py --json     # the same as JSON (tests/test_trace.py reads it)

A learner who wants to understand the whole engine follows one request, reading whole files:
``LLM.generate`` -> ``add_request`` -> ``step`` -> schedule -> block manager and prefix cache ->
inputs -> model -> attention -> sample -> commit -> output.  This script does not list those files
by hand: it runs that request (greedy, on the tiny random model, the ``reference`` backend, with
prefix caching and tenant isolation, the settings the lessons start from), records every minikv
file in which a function ran during ``generate`` (``sys.setprofile``), and counts each file's lines,
docstrings and comments included.  So the figure docs/ARCHITECTURE.md quotes stays true as the code
changes, and ``tests/test_trace.py`` holds it to the bar.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def trace(prompt: list[int] | None = None) -> list[tuple[str, int]]:
    """``[(path relative to the repository, lines)]`` of every minikv file a request ran code in,
    in the order the request first entered them."""
    from minikv import LLM, SamplingParams

    llm = LLM("tiny-random", device="cpu", dtype="float32", attention_backend="reference",
              enable_prefix_caching=True, num_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = prompt or list(range(5, 45))
    package = str(ROOT / "minikv")
    seen: dict[str, None] = {}

    def profile(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(package) and f not in seen:
                seen[f] = None

    llm.generate([prompt], params, tenant="alice")  # warm: the same path, nothing first-use only
    sys.setprofile(profile)
    try:
        llm.generate([prompt, prompt[:20]], params, tenant="alice")  # a hit and a fresh prefill, decodes
    finally:
        sys.setprofile(None)
    return [(str(Path(f).relative_to(ROOT)), len(Path(f).read_text(encoding="utf-8").splitlines()))
            for f in seen]


def markdown(files: list[tuple[str, int]]) -> str:
    """The trace as the table in docs/ARCHITECTURE.md ("The map"): step, file, lines."""
    rows = ["| # | file | lines |", "|---|---|---|"]
    rows += [f"| {i} | `{path}` | {n} |" for i, (path, n) in enumerate(files, 1)]
    rows.append(f"| | **{len(files)} files** | **{sum(n for _, n in files)}** |")
    return "\n".join(rows)


def update_doc(files, doc: Path = ROOT / "docs" / "ARCHITECTURE.md") -> None:
    """Replace the map in ``doc`` (from its header row to its totals row) with the live trace."""
    text = doc.read_text(encoding="utf-8")
    start = text.index("| # | file | lines |")
    end = text.index("\n", text.index("| | **", start))
    doc.write_text(text[:start] + markdown(files) + text[end:], encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print JSON: {files: [[path, lines]], total}")
    ap.add_argument("--markdown", action="store_true", help="print the table docs/ARCHITECTURE.md quotes")
    ap.add_argument("--update-doc", action="store_true",
                    help="rewrite that table inside docs/ARCHITECTURE.md in place")
    args = ap.parse_args(argv)
    files = trace()
    total = sum(n for _, n in files)
    if args.json:
        print(json.dumps({"files": files, "total": total}))
        return 0
    if args.markdown:
        print(markdown(files))
        return 0
    if args.update_doc:
        update_doc(files)
        return 0
    for path, n in files:
        print(f"{n:6d}  {path}")
    print(f"{total:6d}  in {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
