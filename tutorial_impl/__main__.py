"""``python -m tutorial_impl <section> [options]`` and ``python -m tutorial_impl bench <name>``.

Each section is a module with a ``main(argv)`` of its own, like the one-script-per-concept
examples in pytorch/examples; this file only dispatches. Modules are imported only when
chosen, so ``--help`` answers without importing torch.
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> (module, one-line description), in tutorial order.
SECTIONS: dict[str, tuple[str, str]] = {
    "setup": (
        "tutorial_impl.dist_tuto.init_methods",
        "1. + 5.2 the run template; env://, tcp://, file://",
    ),
    "p2p": ("tutorial_impl.dist_tuto.p2p", "2.1 blocking send/recv and 2.2 isend/irecv + wait"),
    "collectives": (
        "tutorial_impl.dist_tuto.collectives",
        "3. all_reduce with every ReduceOp, groups, ...",
    ),
    "train": ("tutorial_impl.dist_tuto.sgd", "4. distributed synchronous SGD on MNIST-shaped data"),
    "ring": (
        "tutorial_impl.dist_tuto.ring",
        "4.5 the tutorial's ring allreduce and a bandwidth-optimal one",
    ),
    "rpc": (
        "tutorial_impl.rpc.demo",
        "RPC framework: rpc_sync/async/remote, RRef, dist autograd, optimizer, timeouts, ...",
    ),
    "hybrid": ("tutorial_impl.rpc.hybrid", "DDP + RPC: DDP trainers, a master, parameter servers"),
    "pictures": (
        "tutorial_impl.pictures",
        "the images in docs/images, drawn from recorded runs of the lessons",
    ),
}
BENCHES: dict[str, tuple[str, str]] = {
    "harness": ("tutorial_impl.bench.harness", "per-test overhead: harness vs mp.spawn"),
    "ring": ("tutorial_impl.bench.ring", "tutorial ring vs bandwidth-optimal ring vs gloo"),
    "ddp-rpc": ("tutorial_impl.bench.ddp_rpc", "the DDP + RPC benchmark (trainers, PS, master)"),
    "library": (
        "tutorial_impl.bench.library",
        "a library's suite per test: spawn pool vs fresh ranks vs warm worlds",
    ),
    "fresh-profile": (
        "tutorial_impl.bench.fresh_profile",
        "where a fresh test of that suite spends its time and CPU, step by step",
    ),
}


def _usage() -> str:
    lines = ["usage: python -m tutorial_impl <section> [options]   (--help after a section)"]
    lines.append("       python -m tutorial_impl bench <name> [options]\n\nsections:")
    lines += [f"  {name:<12} {text}" for name, (_, text) in SECTIONS.items()]
    lines.append("\nbenchmarks (python -m tutorial_impl bench <name>):")
    lines += [f"  {name:<12} {text}" for name, (_, text) in BENCHES.items()]
    return "\n".join(lines)


def _dispatch(table: dict[str, tuple[str, str]], kind: str, argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in table:
        print(f"unknown {kind} {name!r}; choose one of: {', '.join(table)}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    module = importlib.import_module(table[name][0])
    return int(module.main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "bench":
            return _dispatch(BENCHES, "benchmark", argv[1:])
        return _dispatch(SECTIONS, "section", argv)
    except KeyboardInterrupt:
        # Ctrl-C: the launcher has already killed every rank on its way out (its finally);
        # a traceback of where the parent happened to be waiting would tell the user nothing.
        print("interrupted; all ranks stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A torchrun worker: end without interpreter finalization (process.exit_process says
        # why). Imported only here, so that `--help` answers without importing torch.
        from tutorial_impl.dist_tuto.process import run_main

        run_main(main)
    sys.exit(main())
