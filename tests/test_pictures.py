"""``python -m tutorial_impl pictures``: the course's images, one command, from real runs.

The ring images are drawn from a trace of both rings running on 4 ranks (whether that trace
is each algorithm's schedule is ``tests/dist_tuto/test_06_ring.py``'s job). Here: the command
writes every image where it is told to, the README shows each committed image, and without
matplotlib (an optional extra) the command says what to install instead of a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tutorial_impl import __main__ as cli
from tutorial_impl import pictures

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_readme_shows_every_committed_image():
    readme = (REPO / "README.md").read_text()
    for name in pictures.IMAGES:
        assert (REPO / "docs" / "images" / name).read_bytes().startswith(PNG_SIGNATURE)
        assert f"](docs/images/{name})" in readme, f"README.md never shows {name}"


def test_the_command_writes_every_image(tmp_path, capsys):
    """Run as a learner runs it (the section of ``python -m tutorial_impl``), into a folder
    that does not exist yet: 4 ranks trace both rings, then three PNGs are drawn."""
    image = pytest.importorskip("matplotlib.image")
    out = tmp_path / "images"
    assert cli.main(["pictures", "--out", str(out), "--timeout", "60"]) == 0
    assert capsys.readouterr().out.split() == [str(out / name) for name in pictures.IMAGES]
    for name in pictures.IMAGES:
        assert (out / name).read_bytes().startswith(PNG_SIGNATURE)
        height, width, _ = image.imread(out / name).shape
        assert height > 300 and width > 800, (name, width, height)
    # the optimal ring's picture has one panel per step and one for the start: 7, the
    # tutorial ring's 4; both have the same height, so the optimal one is wider
    wide = image.imread(out / "ring_optimal.png").shape[1]
    assert wide > 1.5 * image.imread(out / "ring_tutorial.png").shape[1]


def test_without_matplotlib_the_command_says_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    out = tmp_path / "images"
    assert cli.main(["pictures", "--out", str(out)]) == 2
    assert 'pip install -e ".[plot]"' in capsys.readouterr().err
    assert not out.exists()  # refused before anything was started or written
