"""``python -m tutorial_impl pictures``: the course's images, regenerated from the code.

* ``ring_tutorial.png`` and ``ring_optimal.png``: the tutorial's ring and the bandwidth-optimal
  ring on 4 ranks, step by step. Nothing in them is drawn by hand: the command runs both rings
  on 4 local ranks, recording every message (``dist_tuto/ring_trace.py``), and draws what the
  trace says each rank held, received and sent. (``tests/dist_tuto/test_06_ring.py`` checks
  that trace against each algorithm's schedule.)
* ``hybrid_layout.png``: the DDP + RPC tutorial's processes, what each holds and the messages
  between them, laid out from ``rpc/hybrid_world.py`` (ranks, names) and
  ``rpc/hybrid_model.py`` (sizes) for the tutorial's 2 trainers and 1 parameter server.

matplotlib is an optional extra (``pip install -e ".[plot]"``), imported only here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

RING_SIZE = 4
IMAGES = ("ring_tutorial.png", "ring_optimal.png", "hybrid_layout.png")
PNG_METADATA = {"Software": None}  # no matplotlib version inside: the files change only with
# the drawing, not with whoever regenerated them.


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


# --- The rings --------------------------------------------------------------------------


def _who(ranks: frozenset[int], size: int) -> str:
    return "all" if len(ranks) == size else "+".join(str(r) for r in sorted(ranks))


def _sent_text(pieces: tuple, size: int) -> str:
    if len(pieces) == size and len({who for _, who in pieces}) == 1:
        return f"all {size} chunks ({_who(pieces[0][1], size)})"
    return ", ".join(f"chunk {c} ({_who(who, size)})" for c, who in pieces)


def draw_ring(plt: Any, traces: list[dict], name: str, title: str, path: Path) -> None:
    """One panel per step (and one for the start): each rank's chunks, shaded by how many
    ranks' data they sum; what arrived this step outlined; what left written beside it."""
    size = len(traces)
    steps = [trace[name] for trace in traces]
    count = len(steps[0])
    labels = ["start"]
    for k in range(count):
        if name == "optimal":
            phase = "reduce-scatter" if k < size - 1 else "all-gather"
            labels.append(f"{phase}\nstep {k % (size - 1)}")
        else:
            labels.append(f"step {k}")
    cmap = plt.get_cmap("Blues")
    fig, axes = plt.subplots(1, count + 1, figsize=(2.35 * (count + 1), 0.62 * size + 1.4))
    for col, ax in enumerate(axes):
        ax.set_xlim(-0.1, size + 0.1)
        ax.set_ylim(-0.6, size)
        ax.invert_yaxis()
        ax.axis("off")
        ax.set_title(labels[col], fontsize=9)
        for rank in range(size):
            if col == 0:
                holds = tuple((c, frozenset({rank})) for c in range(size))
                arrived: set[int] = set()
            else:
                step = steps[rank][col - 1]
                holds, arrived = step.holds, {c for c, _ in step.received}
            for c, who in holds:
                shade = cmap(0.15 + 0.7 * len(who) / size)
                edge = 2.2 if c in arrived else 0.6
                ax.add_patch(
                    plt.Rectangle(
                        (c + 0.05, rank + 0.1),
                        0.9,
                        0.6,
                        facecolor=shade,
                        edgecolor="black",
                        linewidth=edge,
                    )
                )
                dark = len(who) / size > 0.6
                ax.text(
                    c + 0.5,
                    rank + 0.4,
                    _who(who, size),
                    ha="center",
                    va="center",
                    fontsize=6.5,
                    color="white" if dark else "black",
                )
            if col == 0:
                ax.text(-0.1, rank + 0.4, f"rank {rank}", ha="right", va="center", fontsize=8)
            else:
                step = steps[rank][col - 1]
                ax.text(
                    size / 2,
                    rank + 0.85,
                    f"sent {_sent_text(step.sent, size)} -> {step.send_to}",
                    ha="center",
                    va="center",
                    fontsize=5.5,
                    color="firebrick",
                )
        if col == 0:
            for c in range(size):
                ax.text(c + 0.5, -0.15, f"chunk {c}", ha="center", fontsize=6.5)
    sent_chunks = sum(len(s.sent) for s in steps[0])
    fig.suptitle(
        f"{title}: {count} steps; each rank sends {sent_chunks} chunks, "
        f"{sent_chunks / size:g}x the tensor\n"
        "Boxes: what each rank holds after the step (the ranks whose data it sums); "
        "thick: arrived this step",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)


# --- The DDP + RPC layout ---------------------------------------------------------------


def draw_hybrid_layout(plt: Any, path: Path) -> None:
    """Trainers, master and parameter server: what each holds, which messages flow."""
    from tutorial_impl.rpc import hybrid_world as world
    from tutorial_impl.rpc.hybrid import HybridConfig
    from tutorial_impl.rpc.hybrid_model import EMBEDDING_DIM, NUM_CLASSES, NUM_EMBEDDINGS

    config = HybridConfig()  # the tutorial's 2 trainers and 1 parameter server
    table = f'EmbeddingBag({NUM_EMBEDDINGS}, {EMBEDDING_DIM}, mode="sum")'
    fc = f"Linear({EMBEDDING_DIM}, {NUM_CLASSES})"
    boxes: dict[str, tuple[float, float, str, str]] = {}  # name -> x, y, title, text
    master = world.master_rank(config)
    boxes[world.MASTER] = (
        5.0,
        8.2,
        f"rank {master}: {world.MASTER}",
        "puts the table on the parameter server\n(RemoteModule), then runs _run_trainer\n"
        "on every trainer (rpc_async) and waits;\nholds only references (RRefs)",
    )
    for i in range(config.trainers):
        boxes[world.trainer_name(i)] = (
            1.6 + 6.8 * i,
            4.3,
            f"rank {i}: {world.trainer_name(i)}",
            f"HybridModel: DDP({fc}) replica,\nthe table only as a RemoteModule\n"
            "get_next_batch: its own batches\nDistributedOptimizer over RRefs\n"
            "(remote_parameters() + its fc)",
        )
    for j in range(config.parameter_servers):
        boxes[world.ps_name(j)] = (
            5.0,
            0.6,
            f"rank {world.ps_rank(config, j)}: {world.ps_name(j)}",
            f"the embedding table:\n{table};\nits gradients, per dist-autograd context;\n"
            "the optimizer's step on its rows",
        )
    fig, ax = plt.subplots(figsize=(9.5, 7.2))
    ax.set_xlim(-1.2, 11.2)
    ax.set_ylim(-0.5, 10.6)
    ax.axis("off")
    colours = {"master": "#fde2b8", "trainer": "#cfe3f7", "ps": "#d5efd0"}
    for name, (x, y, title, text) in boxes.items():
        kind = (
            "trainer" if name.startswith("trainer") else "ps" if name.startswith("ps") else "master"
        )
        ax.add_patch(
            plt.Rectangle((x - 2.1, y - 0.2), 4.2, 1.75, facecolor=colours[kind], edgecolor="black")
        )
        ax.text(x, y + 1.3, title, ha="center", va="center", fontsize=9, weight="bold")
        ax.text(x, y + 0.55, text, ha="center", va="center", fontsize=7)

    def arrow(
        a: tuple[float, float],
        b: tuple[float, float],
        text: str,
        colour: str,
        at: tuple[float, float],
        both: bool = False,
    ) -> None:
        style = "<|-|>" if both else "-|>"
        ax.annotate(
            "", xy=b, xytext=a, arrowprops={"arrowstyle": style, "color": colour, "lw": 1.4}
        )
        ax.text(
            *at,
            text,
            ha="center",
            va="center",
            fontsize=6.8,
            color=colour,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
        )

    rpc_colour, pg_colour = "#b35806", "#2166ac"
    ps = boxes[world.ps_name(0)]
    for i in range(config.trainers):
        tx, ty = boxes[world.trainer_name(i)][:2]
        side = -1 if tx < 5 else 1
        arrow(
            (5.0 + 0.8 * side, 8.0),
            (tx, ty + 1.55),
            "RPC: rpc_async(_run_trainer,\nremote_emb_module)",
            rpc_colour,
            (tx + 0.2 * side, 6.75),
        )
        arrow(
            (tx + 0.4 * side, ty - 0.2),
            (ps[0] + 1.2 * side, ps[1] + 1.55),
            "RPC: forward (indices, offsets)\n-> summed rows (bags x 16);\n"
            "dist autograd: their gradient;\nDistributedOptimizer.step",
            rpc_colour,
            (tx - 0.1 * side, 2.6),
            both=True,
        )
    arrow(
        (boxes["trainer0"][0] + 2.1, 5.3),
        (boxes["trainer1"][0] - 2.1, 5.3),
        "gloo group of the trainers only:\nDDP all_reduce of the fc gradients",
        pg_colour,
        (5.0, 5.3),
        both=True,
    )
    arrow(
        (5.0, 8.0),
        (5.0, 2.35),
        f'RPC: RemoteModule("{world.ps_name(0)}/cpu", ...)\nbuilds the table there\n'
        "from the master's rows",
        rpc_colour,
        (5.0, 3.1),
    )
    ax.text(
        5.0,
        10.3,
        "DDP + RPC (the hybrid tutorial): orange = RPC (every process), blue = the "
        "trainers' process group",
        ha="center",
        fontsize=8.5,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)


# --- Command line -----------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tutorial_impl pictures",
        description="Regenerate the course's images: both rings step by step, from a trace of "
        "a real 4-rank run, and the DDP + RPC layout (needs matplotlib: pip install -e .[plot])",
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
    from tutorial_impl.dist_tuto.ring_trace import trace_rings

    args.out.mkdir(parents=True, exist_ok=True)
    traces: list[dict] = []
    status = cli.exit_status(
        lambda: traces.extend(cli.launch(trace_rings, RING_SIZE, "gloo", args.timeout))
    )
    if status:
        return status
    draw_ring(
        plt, traces, "tutorial", "The tutorial's ring allreduce, 4 ranks", args.out / IMAGES[0]
    )
    draw_ring(
        plt,
        traces,
        "optimal",
        "The bandwidth-optimal ring allreduce, 4 ranks",
        args.out / IMAGES[1],
    )
    draw_hybrid_layout(plt, args.out / IMAGES[2])
    for name in IMAGES:
        print(args.out / name)
    return 0
