"""Fail loudly unless this machine can run the GPU tests: a CUDA build of torch, a working
driver, NCCL, and at least ``--min-gpus`` GPUs.

The GPU job runs ``pytest -m gpu``; every test it selects skips at collection time when CUDA
is missing or GPUs are too few, and pytest exits 0 when everything was skipped. So without
this check (and ``--require-gpu``) the job would go green on a runner whose driver is too old
for the wheel, on a one-GPU runner, or with a CPU build of torch that pip preferred.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-gpus", type=int, default=2, help="GPUs the gpu tests need")
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}")
    problems = []
    if torch.version.cuda is None:
        problems.append("this is a CPU build of torch (check the index pip used)")
    elif not torch.cuda.is_available():
        problems.append("CUDA is not available (driver missing or too old for this build?)")
    elif torch.cuda.device_count() < args.min_gpus:
        problems.append(f"{torch.cuda.device_count()} GPU(s) visible, need {args.min_gpus}")
    if torch.version.cuda is not None and not dist.is_nccl_available():
        problems.append("NCCL is not available in this build")
    for i in range(torch.cuda.device_count() if not problems else 0):
        print(f"  cuda:{i} {torch.cuda.get_device_name(i)}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
