"""What a benchmark prints around its table: the Info section, a baseline, a plot.

Kept apart from the workers so that none of it runs in a rank, and so that the optional
pieces stay optional: ``nvidia-smi`` is only called where it exists, and matplotlib is only
imported when a plot is asked for.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch


def write_json(figures: Mapping[str, object], path: str | None) -> None:
    """The figures as JSON at ``path`` (a benchmark's ``--json``), if one was given."""
    if path:
        Path(path).write_text(json.dumps(figures, indent=2))


def info_section() -> str:
    """PyTorch and CUDA versions, and the GPU topology when ``nvidia-smi`` is there."""
    lines = ["---------- Info ----------", "", f"* PyTorch version: {torch.__version__}"]
    lines.append(f"* CPU cores: {os.cpu_count()}")
    if torch.version.cuda:
        lines.append(f"* CUDA version: {torch.version.cuda}")
        lines.append(f"* GPUs visible: {torch.cuda.device_count()}")
    else:
        lines.append("* CUDA: none (CPU build of torch)")
    smi = shutil.which("nvidia-smi")
    if smi:
        lines += ["", "---------- nvidia-smi topo -m ----------", ""]
        try:
            done = subprocess.run(
                [smi, "topo", "-m"], capture_output=True, text=True, timeout=20, check=True
            )
            lines.append(done.stdout.rstrip())
        except (subprocess.SubprocessError, OSError) as exc:
            # The topology is a nicety; a broken driver must not stop the benchmark.
            lines.append(f"(nvidia-smi topo -m failed: {exc})")
    return "\n".join(lines)


def spawn_baseline(n: int, module: str = "torch.distributed.rpc", timeout: float = 300.0) -> float:
    """Seconds to start ``n`` fresh interpreters at once, each importing ``module``.

    This is what ``mp.spawn`` (the original's launcher) pays before a worker runs a line of
    its own: one interpreter and one ``import torch`` per process, all competing for the
    same cores.
    """
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", f"import {module}"]) for _ in range(n)]
    try:
        for p in procs:
            p.wait(timeout=max(0.1, timeout - (time.perf_counter() - start)))
            if p.returncode:
                raise RuntimeError(f"'{sys.executable} -c import {module}' failed")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return time.perf_counter() - start


def process_start_time(pid: int | None = None) -> float | None:
    """When a process (default: this one) started, as a ``time.time()``; None off Linux.

    The kernel keeps each process's start in clock ticks since boot (``/proc/PID/stat``,
    field 22); the boot clock says how long ago that was. Good to a tick (10 ms).
    """
    try:
        with open(f"/proc/{pid or 'self'}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot_epoch_times(per_trainer: Mapping[str, Sequence[float]], path: str, title: str) -> None:
    """A box plot of each trainer's timed epochs, saved to ``path`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt

    names = list(per_trainer)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.8 * len(names) + 2), 4))
    ax.boxplot([list(per_trainer[n]) for n in names], whis=(5, 95))
    ax.set_xticks(range(1, len(names) + 1), names, rotation=45 if len(names) > 6 else 0)
    ax.set_ylabel("seconds per epoch")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
