"""Where this pytest process stands in a torchrun job, read from its environment.

``torchrun --nnodes=2 --nproc-per-node=2 -m pytest`` starts four pytest processes, each one a
rank of the job (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` in
its environment). ``detect`` reads that into a ``Launch`` (``chosen``: as ``--launcher``
asks); ``why_not_here`` says which tests the job can run; ``basetemp`` gives each rank a
temporary directory of its own. What the session then shares between its tests is ``job.Job``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from tutorial_impl.testing import backends

# What torchrun (and torch.distributed.launch, and an srun that starts torchrun) puts in
# every worker's environment.
LAUNCH_ENV = (
    "TORCHELASTIC_RUN_ID",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@dataclass(frozen=True)
class Launch:
    """This worker's place in the launched job, read from its environment."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    run_id: str
    restart: int
    agent_store: bool  # the agent hosts the store (torchrun's default); else rank 0 does

    @property
    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} (torchrun job {self.run_id})"


def detect(environ: dict[str, str] | os._Environ[str] = os.environ) -> Launch | None:
    """The launch this process is part of, or None when torchrun did not start it.

    A malformed variable is a ValueError naming it, never a silent forked run."""
    if not all(name in environ for name in LAUNCH_ENV):
        return None
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        try:
            numbers[name] = int(environ[name])
        except ValueError:
            raise ValueError(
                f"torchrun variable {name}={environ[name]!r} is not a number"
            ) from None
    if not 0 <= numbers["RANK"] < numbers["WORLD_SIZE"]:
        raise ValueError(
            f"RANK={numbers['RANK']} is not a rank of WORLD_SIZE={numbers['WORLD_SIZE']}"
        )
    return Launch(
        rank=numbers["RANK"],
        world_size=numbers["WORLD_SIZE"],
        local_rank=numbers["LOCAL_RANK"],
        master_addr=environ["MASTER_ADDR"],
        master_port=numbers["MASTER_PORT"],
        run_id=environ["TORCHELASTIC_RUN_ID"],
        restart=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
    )


def chosen(choice: str, numprocesses: int | None = None) -> Launch | None:
    """This run's place in a torchrun job as ``--launcher`` ``choice`` has it, or None for
    forked ranks (``fork``, or ``auto`` outside torchrun). ``torchrun`` outside a job, a
    malformed launch, or xdist's ``-n`` (``numprocesses``) under one is a ValueError that
    says so (the plugin's usage error)."""
    if choice == "fork":
        return None
    try:
        launch = detect()
    except ValueError as exc:
        raise ValueError(f"--launcher {choice}: {exc}") from None
    if launch is None:
        if choice == "torchrun":
            raise ValueError(
                "--launcher torchrun: this pytest was not started by torchrun (it needs all of "
                f"{', '.join(LAUNCH_ENV)} in its environment); run "
                "`torchrun --nproc-per-node=N -m pytest ...`"
            )
        return None
    if numprocesses:
        raise ValueError(
            "-n/--numprocesses cannot be used under torchrun: every torchrun worker is one "
            "rank and runs the whole session; drop -n (or use --launcher fork)"
        )
    return launch


# --- what a launched job can run ------------------------------------------------------------


def size_mismatch(world_size: int, launch: Launch) -> str:
    return (
        f"needs world_size {world_size}; this torchrun job has {launch.world_size} ranks "
        "(under torchrun a test runs on the whole job: launch it with that many workers)"
    )


def why_not_here(launch: Launch, settings: Any) -> str | None:
    """Why this job cannot run a test with these settings (``config.Settings``), or None.

    A world size other than the job's is skipped (not run on a subgroup: a test's
    collectives on the default group must mean the whole world it asked for). A GPU test
    needs LOCAL_RANK's GPU on every rank."""
    if settings.world_size != launch.world_size:
        return size_mismatch(settings.world_size, launch)
    reason = backends.why_not_here(settings.backend, 1, 1 if settings.gpus else 0)
    if reason or not settings.gpus:
        return reason
    import torch

    if torch.cuda.device_count() <= launch.local_rank:
        return f"LOCAL_RANK {launch.local_rank} has no GPU ({torch.cuda.device_count()} visible)"
    return None


def basetemp(launch: Launch) -> str:
    """A temporary directory of this rank's own, under pytest's usual per-user root."""
    import getpass
    import tempfile

    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no name for this uid (a container)
        user = "unknown"
    root = os.path.join(tempfile.gettempdir(), f"pytest-of-{user}")
    return os.path.join(root, f"torchrun-{launch.run_id[:12]}-rank{launch.rank}")
