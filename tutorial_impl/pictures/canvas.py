"""A picture drawn in pixels, at the README's width, that checks itself when saved.

Every picture of the course is laid out on a ``Canvas``: a matplotlib figure whose one axes
spans it, in pixel coordinates (x to the right, y down), saved at ``DPI``. A picture is
readable at the README's width only if it is no wider (``README_WIDTH``: GitHub's column
scales a wider one down, and its text with it) and its text is large enough there
(``MIN_FONT_PT``: 8 pt at 100 dpi is 11 pixels). So the canvas refuses a smaller font, and
``save`` measures what was drawn, with matplotlib's own font metrics:

* ``crossings``: each text that an arrow or a line runs through, or that overlaps another text, or
  that sticks out of the picture;
* the picture's size in pixels and its smallest font in pixels.

``Drawn`` carries the result; ``tests/test_pictures.py`` checks it for every picture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DPI = 100
README_WIDTH = 840  # pixels: GitHub's README column (about 830 to 900) shows this unscaled
MIN_FONT_PT = 8.0  # 11.1 pixels at DPI
TITLE_PT = 9.5
PNG_METADATA = {"Software": None}  # no matplotlib version inside: the files change only with
# the drawing, not with whoever regenerated them.


def px(points: float) -> float:
    """A font size in points, in pixels at ``DPI``."""
    return points * DPI / 72


@dataclass
class Drawn:
    """What ``Canvas.save`` wrote and measured."""

    path: Path
    width: int
    height: int
    min_font_px: float
    crossings: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # every text drawn, in drawing order
    boxes: list[tuple[float, float, float, float]] = field(default_factory=list)  # x, y, w, h


class Canvas:
    """A ``width`` x ``height`` pixel picture: boxes, texts and arrows, in pixels."""

    def __init__(self, plt: Any, width: int, height: int) -> None:
        self.plt, self.width, self.height = plt, width, height
        self.fig = plt.figure(figsize=(width / DPI, height / DPI), dpi=DPI)
        self.ax = self.fig.add_axes((0, 0, 1, 1))
        self.ax.set_xlim(0, width)
        self.ax.set_ylim(height, 0)
        self.ax.axis("off")
        self.texts: list[Any] = []
        self.boxes: list[tuple[float, float, float, float]] = []  # in drawing order
        self.paths: list[list[tuple[float, float]]] = []  # arrows and lines, checked

    def heading(self, lines: list[str]) -> float:
        """The title (bold) and its explanation lines at the top; the y below them."""
        y = 14.0
        for i, line in enumerate(lines):
            if i == 0:
                self.text(self.width / 2, y, line, size=TITLE_PT, weight="bold")
            else:
                self.text(self.width / 2, y, line)
            y += 17
        return y + 4

    def box(self, x: float, y: float, w: float, h: float, **style: Any) -> None:
        """A rectangle with its top left corner at ``(x, y)``."""
        style = {"facecolor": "white", "edgecolor": "black", "linewidth": 1.0, **style}
        self.ax.add_patch(self.plt.Rectangle((x, y), w, h, **style))
        self.boxes.append((x, y, w, h))

    def text(self, x: float, y: float, s: str, size: float = MIN_FONT_PT, **style: Any) -> Any:
        """``s`` at ``(x, y)``, centred there unless ``ha``/``va`` say otherwise."""
        if size < MIN_FONT_PT:
            raise ValueError(f"{size} pt is below {MIN_FONT_PT} pt, unreadable at the README")
        style = {"ha": "center", "va": "center", **style}
        t = self.ax.text(x, y, s, fontsize=size, **style)
        self.texts.append(t)
        return t

    def line(self, points: list[tuple[float, float]], checked: bool = True, **style: Any) -> None:
        """A line without a head; ``checked=False``: one texts may sit on (a lifeline)."""
        xs, ys = zip(*points, strict=True)
        self.ax.plot(xs, ys, **{"color": "black", "linewidth": 1.0, **style})
        if checked:
            self.paths.append(list(points))

    def arrow(
        self,
        points: list[tuple[float, float]],
        colour: str = "black",
        both: bool = False,
        dashed: bool = False,
        width: float = 1.3,
    ) -> None:
        """An arrow along ``points`` (head at the last; at both ends if ``both``)."""
        from matplotlib.patches import FancyArrowPatch
        from matplotlib.path import Path as MplPath

        self.ax.add_patch(
            FancyArrowPatch(
                path=MplPath(points),
                arrowstyle="<|-|>" if both else "-|>",
                mutation_scale=11,
                color=colour,
                linewidth=width,
                linestyle="--" if dashed else "-",
                shrinkA=0,
                shrinkB=0,
            )
        )
        self.paths.append(list(points))

    def save(self, path: Path) -> Drawn:
        """Write the PNG, measure it, close the figure."""
        self.fig.savefig(path, dpi=DPI, metadata=PNG_METADATA)
        drawn = Drawn(
            path,
            self.width,
            self.height,
            min((px(t.get_fontsize()) for t in self.texts), default=0.0),
            crossings(self),
            [t.get_text() for t in self.texts],
            list(self.boxes),
        )
        self.plt.close(self.fig)
        return drawn


def _label(t: Any) -> str:
    return repr(t.get_text().replace("\n", " ")[:40])


def crossings(canvas: Canvas) -> list[str]:
    """Every text an arrow or a line runs through, that overlaps another text, or that
    leaves the picture; in display coordinates, from the renderer's own measure of each
    text. (numpy finds the candidate pairs; matplotlib decides each path's.)"""
    import numpy as np
    from matplotlib.path import Path as MplPath

    renderer = canvas.fig.canvas.get_renderer()
    texts = [t for t in canvas.texts if t.get_text().strip()]
    if not texts:
        return []
    boxes = [t.get_window_extent(renderer).padded(1.0) for t in texts]
    b = np.array([box.extents for box in boxes])  # x0, y0, x1, y1 per text
    found = []
    (fx0, fy0), (fx1, fy1) = canvas.fig.bbox.get_points()
    outside = (b[:, 0] < fx0) | (b[:, 1] < fy0) | (b[:, 2] > fx1) | (b[:, 3] > fy1)
    found += [f"text {_label(texts[i])} leaves the picture" for i in np.flatnonzero(outside)]
    overlap = (b[:, None, 0] < b[None, :, 2]) & (b[None, :, 0] < b[:, None, 2])
    overlap &= (b[:, None, 1] < b[None, :, 3]) & (b[None, :, 1] < b[:, None, 3])
    for i, j in zip(*np.nonzero(np.triu(overlap, 1)), strict=True):
        found.append(f"texts {_label(texts[i])} and {_label(texts[j])} overlap")
    for points in canvas.paths:
        shown = canvas.ax.transData.transform(points)
        (lx0, ly0), (lx1, ly1) = shown.min(axis=0), shown.max(axis=0)
        near = (b[:, 0] <= lx1) & (lx0 <= b[:, 2]) & (b[:, 1] <= ly1) & (ly0 <= b[:, 3])
        for i in np.flatnonzero(near):
            if MplPath(shown).intersects_bbox(boxes[i], filled=False):
                found.append(f"a line from {points[0]} to {points[-1]} crosses {_label(texts[i])}")
    return found
