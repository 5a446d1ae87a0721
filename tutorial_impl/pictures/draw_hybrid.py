"""The DDP + RPC tutorial's processes, what each holds and the messages between them.

Laid out from ``rpc/hybrid_world.py`` (ranks, names) and ``rpc/hybrid_model.py`` (sizes) for
the tutorial's 2 trainers and 1 parameter server. Four processes that all talk to each other
make a drawing where two arrows must cross, unless one process sits inside the triangle of
the other three: here the parameter server, between the master above and the trainers below.
So no arrow crosses another, and (checked by the canvas) none crosses a label.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tutorial_impl.pictures.canvas import README_WIDTH, Canvas, Drawn

RPC_COLOUR, GROUP_COLOUR = "#b35806", "#2166ac"
COLOURS = {"master": "#fde2b8", "trainer": "#cfe3f7", "ps": "#d5efd0"}
# name -> (left, top, width, height) in pixels
MASTER, PS = (270.0, 62.0, 300.0, 84.0), (270.0, 252.0, 300.0, 84.0)
TRAINERS = ((10.0, 452.0, 290.0, 100.0), (540.0, 452.0, 290.0, 100.0))


def _process(c: Canvas, where: tuple, kind: str, title: str, text: str) -> None:
    x, y, w, h = where
    c.box(x, y, w, h, facecolor=COLOURS[kind])
    c.text(x + w / 2, y + 12, title, weight="bold")
    c.text(x + w / 2, y + 20 + (h - 20) / 2, text, linespacing=1.35)


def _texts() -> dict[str, tuple[str, str]]:
    """Each process's title and what it holds, from the hybrid modules."""
    from tutorial_impl.rpc import hybrid_world as world
    from tutorial_impl.rpc.hybrid import HybridConfig
    from tutorial_impl.rpc.hybrid_model import EMBEDDING_DIM, NUM_CLASSES, NUM_EMBEDDINGS

    config = HybridConfig()  # the tutorial's 2 trainers and 1 parameter server
    fc = f"Linear({EMBEDDING_DIM}, {NUM_CLASSES})"
    found = {
        "master": (
            f"rank {world.master_rank(config)}: {world.MASTER}",
            "puts the table on the parameter server,\nruns _run_trainer on every trainer;\n"
            "holds only references (RRefs)",
        ),
        "ps": (
            f"rank {world.ps_rank(config, 0)}: {world.ps_name(0)}",
            f'the table: EmbeddingBag({NUM_EMBEDDINGS}, {EMBEDDING_DIM}, mode="sum");\n'
            "its gradients, per dist-autograd context;\nthe optimizer's step on its rows",
        ),
    }
    for i in range(config.trainers):
        found[f"trainer{i}"] = (
            f"rank {i}: {world.trainer_name(i)}",
            f"HybridModel: DDP({fc}) replica;\nthe table only as a RemoteModule;\n"
            "get_next_batch: its own batches;\nDistributedOptimizer over RRefs",
        )
    return found


def draw_hybrid_layout(plt: Any, path: Path) -> Drawn:
    """The master above, the parameter server in the middle, the trainers below."""
    texts = _texts()
    c = Canvas(plt, README_WIDTH, 566)
    c.heading(
        [
            "DDP + RPC (the hybrid tutorial): who holds what",
            "Orange: RPC (every process); blue: the trainers' own gloo process group",
        ],
    )
    _process(c, MASTER, "master", *texts["master"])
    _process(c, PS, "ps", *texts["ps"])
    for i, where in enumerate(TRAINERS):
        _process(c, where, "trainer", *texts[f"trainer{i}"])
    (t0x, t0y, t0w, _), (t1x, _, t1w, t1h) = TRAINERS
    # master -> trainers: the triangle's sides, from the master's sides to the trainers' tops
    c.arrow([(MASTER[0], 120), (t0x + t0w / 2, t0y)], colour=RPC_COLOUR)
    c.arrow([(MASTER[0] + MASTER[2], 120), (t1x + t1w / 2, t0y)], colour=RPC_COLOUR)
    for x in (95, 745):
        c.text(x, 215, "RPC: rpc_async(\n_run_trainer,\nremote_emb_module)", color=RPC_COLOUR)
    # master -> parameter server
    c.arrow([(420, MASTER[1] + MASTER[3]), (420, PS[1])], colour=RPC_COLOUR)
    c.text(
        428,
        199,
        'RPC: RemoteModule(\n"ps0/cpu", ...) builds\nthe table there',
        ha="left",
        color=RPC_COLOUR,
    )
    # trainers <-> parameter server
    c.arrow([(285, PS[1] + PS[3]), (200, t0y)], colour=RPC_COLOUR, both=True)
    c.arrow([(555, PS[1] + PS[3]), (640, t0y)], colour=RPC_COLOUR, both=True)
    c.text(
        420,
        392,
        "RPC, each trainer: forward(indices, offsets)\nreturns summed rows (bags x 16); dist "
        "autograd\nsends back their gradients; optimizer step",
        color=RPC_COLOUR,
    )
    # trainers <-> trainers
    c.arrow([(t0x + t0w, 490), (t1x, 490)], colour=GROUP_COLOUR, both=True)
    c.text(
        420,
        520,
        "gloo group of the trainers:\nDDP's all_reduce of the\nfc gradients",
        color=GROUP_COLOUR,
    )
    return c.save(path)
