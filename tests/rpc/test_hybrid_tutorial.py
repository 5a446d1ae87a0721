"""The DDP + RPC tutorial's program as written (``tutorial_impl/rpc/hybrid_tutorial.py``).

``run_worker`` is the tutorial's function for one of its four processes; here the harness
starts the four (where the tutorial's ``mp.spawn`` would), with ``file://`` rendezvous for
the trainers' process group and for RPC instead of the tutorial's fixed ports. One epoch of
the tutorial's ten batches must run on both trainers, every process must end cleanly
(``rpc.shutdown`` waits for all), and the output must be the tutorial's.
"""

from __future__ import annotations

from tutorial_impl.rpc import hybrid_tutorial


def test_the_tutorials_program_trains_and_shuts_down(run_ranks, tmp_path):
    env = {
        "DDP_INIT_METHOD": f"file://{tmp_path / 'ddp'}",
        "RPC_INIT_METHOD": f"file://{tmp_path / 'rpc'}",
    }
    # run_worker(rank, world_size, epochs): world size 4, as the tutorial's mp.spawn, 1 epoch
    results = run_ranks(
        hybrid_tutorial.run_worker, 1, world_size=4, backend=None, env=env, timeout=60
    )
    assert list(results) == [None] * 4  # every process returned: rpc.shutdown completed
    for trainer in (0, 1):  # the tutorial's line, once per epoch, from each trainer
        assert "Training done for epoch 0" in results.outputs[trainer].splitlines()
    for other in (2, 3):  # master and parameter server print nothing of their own
        assert "Training done" not in results.outputs[other]
