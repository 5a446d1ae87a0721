"""DDP in practice, and what came after it: lessons D1-D20 of the course (docs/ddp.md).

D1-D9 follow the first tutorial's T1-T6; D10-D20 follow T7-T9 (docs/course.md's reading
order). In order; lesson DN's tests are ``tests/ddp/test_ddp_NN_<name>.py``:

``toy.py``          the tiny model and the data every lesson uses
``equivalence.py``  D1. DDP takes the step ``average_gradients`` takes, from rank 0's weights
``buckets.py``      D2. buckets: all-reduces per ``bucket_cap_mb``, launched during backward
``no_sync.py``      D3. gradient accumulation: ``no_sync`` for k-1 micro-batches, one sync
``sampler.py``      D4. ``DistributedSampler``: shards, ``set_epoch``, padding, ``drop_last``
``join.py``         D5. uneven inputs: a bare loop blocks (short deadline), ``Join`` finishes
``fsdp.py``         D6. FSDP2 ``fully_shard``: shards before, whole in forward, one step
``dtensor.py``      D7. ``DeviceMesh`` and ``DTensor`` on a 2 x 2 mesh of 4 ranks
``pipeline.py``     D8. ``torch.distributed.pipelining``: 2 stages, 4 micro-batches, GPipe, 1F1B
``torchrun_env.py`` D9. torchrun: who sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE
``tensor_parallel.py`` D10. tensor parallelism (column- then row-wise); FSDP2 + TP on 2 x 2
``checkpoint.py``   D11. ``torch.distributed.checkpoint``: save at 4 ranks, load at 2 and 1
``accelerator.py``  D12. ``torch.accelerator``: one device-agnostic step; NCCL's differences
``compile_ddp.py``  D13. ``torch.compile`` with DDP: the eager step, graphs split at buckets
``comm_hooks.py``   D14. comm hooks: fp16, bf16, PowerSGD; bytes sent and error
``pipeline_ddp.py`` D15. pipeline stages replicated with DDP on a 2 x 2 mesh (case 2)
``tp_transformer.py`` D16. TP for a transformer block: heads, ``SequenceParallel``, loss
``fsdp_practice.py`` D17. FSDP2 in practice: bf16 ``MixedPrecisionPolicy``, HSDP on 2 x 2
``pipeline_schedules.py`` D18. 1F1B, interleaved 1F1B, zero bubble: the bubble, measured
``fsdp_prefetch.py`` D19. FSDP2: explicit prefetching, activation checkpointing
``ring_attention.py`` D20. context parallelism: K/V blocks around a ring, online softmax

Every module except ``toy.py`` runs as a demo: ``python -m tutorial_impl.ddp.<module>``
(``torchrun_env.py`` is a torchrun worker script instead).
"""
