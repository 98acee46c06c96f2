"""Make the README's course-map pictures from the lessons' own committed figures.

    python scripts/make_thumbnails.py

For each ``course/NN_*.ipynb`` it takes the figure chosen by ``THUMB_FIGURE`` (default: the
first PNG output), shrinks it to a thumbnail and writes ``course/figures/thumbs/NN.png``.  The
pictures therefore always show what the lesson really draws.
"""
from __future__ import annotations

import base64
import io
from pathlib import Path

import nbformat
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "course" / "figures" / "thumbs"
THUMB_FIGURE: dict[str, int] = {"02": 2}  # lesson number -> index of the PNG output to use
WIDTH = 320


def pngs(path: Path) -> list[bytes]:
    nb = nbformat.read(path, as_version=4)
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "image/png" in data:
                found.append(base64.b64decode(data["image/png"]))
    return found


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for nb_path in sorted((ROOT / "course").glob("[0-9][0-9]_*.ipynb")):
        num = nb_path.name[:2]
        images = pngs(nb_path)
        if not images:
            print(f"{nb_path.name}: no figure")
            continue
        img = Image.open(io.BytesIO(images[min(THUMB_FIGURE.get(num, 0), len(images) - 1)])).convert("RGB")
        img.thumbnail((WIDTH, WIDTH))
        img.save(OUT / f"{num}.png", optimize=True)
        print(f"{nb_path.name}: {img.size[0]}x{img.size[1]}")


if __name__ == "__main__":
    main()
