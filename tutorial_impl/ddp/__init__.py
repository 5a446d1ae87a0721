"""DDP in practice, and what came after it: the course after ``dist_tuto`` (docs/ddp.md).

In reading order; each lesson's tests are ``tests/ddp/test_ddp_0N_<name>.py``:

``toy.py``          the tiny model and the data every lesson uses
``equivalence.py``  1. DDP takes the step ``average_gradients`` takes, from rank 0's weights
``buckets.py``      2. buckets: all-reduces per ``bucket_cap_mb``, launched during backward
``no_sync.py``      3. gradient accumulation: ``no_sync`` for k-1 micro-batches, one sync
``sampler.py``      4. ``DistributedSampler``: shards, ``set_epoch``, padding, ``drop_last``
``join.py``         5. uneven inputs: a bare loop blocks (short deadline), ``Join`` finishes
``fsdp.py``         6. FSDP2 ``fully_shard``: shards before, whole in forward, one step
``dtensor.py``      7. ``DeviceMesh`` and ``DTensor`` on a 2 x 2 mesh of 4 ranks
``pipeline.py``     8. ``torch.distributed.pipelining``: 2 stages, 4 micro-batches, GPipe, 1F1B
``torchrun_env.py`` 9. torchrun: who sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE
``tensor_parallel.py`` 10. tensor parallelism (column- then row-wise); FSDP2 + TP on 2 x 2
``checkpoint.py``   11. ``torch.distributed.checkpoint``: save at 4 ranks, load at 2 and 1
``accelerator.py``  12. ``torch.accelerator``: one device-agnostic step; NCCL's differences
``compile_ddp.py``  13. ``torch.compile`` with DDP: the eager step, graphs split at buckets
``comm_hooks.py``   14. comm hooks: fp16, bf16, PowerSGD; bytes sent and error
``pipeline_ddp.py`` 15. pipeline stages replicated with DDP on a 2 x 2 mesh (case 2)

Every module except ``toy.py`` runs as a demo: ``python -m tutorial_impl.ddp.<module>``
(``torchrun_env.py`` is a torchrun worker script instead).
"""
