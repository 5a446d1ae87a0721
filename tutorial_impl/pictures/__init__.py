"""``python -m tutorial_impl pictures``: the course's images, regenerated from real runs.

Nothing in them is typed by hand. The command runs the lessons' own code on local ranks,
recording it (``record.py``: one gloo world of 4 ranks, one RPC world of 3 workers), then
draws each picture from what was recorded:

* ``p2p_timeline.png``: lesson 2's blocking and non-blocking send on one clock;
* ``collectives.png``: what each collective of lesson 3 took and gave, rank by rank;
* ``ring_tutorial.png``, ``ring_optimal.png``: both rings of 4.5, step by step;
* ``rref_protocol.png``: the RRef lifetime lesson between three workers, each step's
  messages and each worker's RRef bookkeeping after it;
* ``autograd_graph.png``: the graph distributed autograd built for the design note's
  forward, send and recv functions included;
* ``ddp_buckets.png``: DDP's all_reduces launched during backward, bucket by bucket;
* ``pipeline_schedules.png``: D18's three pipeline schedules, each rank's recorded order
  replayed, the bubble in white;
* ``hybrid_layout.png``: the DDP + RPC tutorial's processes, laid out from
  ``rpc/hybrid_world.py`` and ``rpc/hybrid_model.py``.

Every picture is drawn on a ``canvas.Canvas`` at the README's width, and measured when
saved (``canvas.Drawn``: size, smallest font, labels crossed or overlapping).
``tests/test_pictures.py`` checks those measures, and each recording against an independent
reference. matplotlib is an optional extra (``pip install -e ".[plot]"``), imported only
when drawing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

IMAGES = (
    "p2p_timeline.png",
    "collectives.png",
    "ring_tutorial.png",
    "ring_optimal.png",
    "rref_protocol.png",
    "autograd_graph.png",
    "ddp_buckets.png",
    "pipeline_schedules.png",
    "hybrid_layout.png",
)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def draw(plt: Any, recorded: Any, out: Path) -> list[Any]:
    """Every picture from ``recorded`` (a ``record.Recordings``), into ``out``, in the order
    of ``IMAGES``; what each one measured (``canvas.Drawn``)."""
    from tutorial_impl.pictures import (
        draw_ddp,
        draw_dist_tuto,
        draw_hybrid,
        draw_pipeline,
        draw_rpc,
    )
    from tutorial_impl.pictures.record import BUCKET_CAP_MB

    images = dict(zip(IMAGES, (out / name for name in IMAGES), strict=True))
    rings = recorded.rings
    return [
        draw_dist_tuto.draw_p2p(plt, recorded.p2p, images["p2p_timeline.png"]),
        draw_dist_tuto.draw_collectives(plt, recorded.collectives, images["collectives.png"]),
        draw_dist_tuto.draw_ring(
            plt, rings, "tutorial", "The tutorial's ring allreduce", images["ring_tutorial.png"]
        ),
        draw_dist_tuto.draw_ring(
            plt, rings, "optimal", "The bandwidth-optimal ring", images["ring_optimal.png"]
        ),
        draw_rpc.draw_rref_protocol(plt, recorded.rref, images["rref_protocol.png"]),
        draw_rpc.draw_autograd_graph(plt, recorded.autograd, images["autograd_graph.png"]),
        draw_ddp.draw_buckets(
            plt, recorded.bucket_calls, recorded.ready, BUCKET_CAP_MB, images["ddp_buckets.png"]
        ),
        draw_pipeline.draw_schedules(plt, recorded.schedules, images["pipeline_schedules.png"]),
        draw_hybrid.draw_hybrid_layout(plt, images["hybrid_layout.png"]),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl pictures",
        description="Regenerate the course's images from recorded runs of the lessons' own "
        "code (needs matplotlib: pip install -e .[plot])",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("docs/images"),
        help="folder to write the PNGs to (default: docs/images)",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds before the ranks are stopped"
    )
    args = parser.parse_args(argv)
    plt = _pyplot()
    if plt is None:  # say so before any rank starts
        print('error: the pictures need matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    from tutorial_impl import cli  # the CLI's launcher, not the tutorial's
    from tutorial_impl.pictures.record import record

    recorded: list[Any] = []
    status = cli.exit_status(lambda: recorded.append(record(args.timeout)))
    if status:
        return status
    args.out.mkdir(parents=True, exist_ok=True)
    for drawn in draw(plt, recorded[0], args.out):
        print(drawn.path)
        for problem in drawn.crossings:  # a drawing bug: say so, the picture is still written
            print(f"warning: {drawn.path.name}: {problem}", file=sys.stderr)
    return 0
