"""The Distributed RPC Framework (shared/seeds/003) and Combining DDP with it (000, 001).

The RPC framework itself, one module per part of the reference, in reading order:

``workers.py``        init_rpc with TensorPipe options and BackendType, worker names,
                      graceful shutdown and what it waits for
``calls.py``          rpc_sync, rpc_async, remote, and when each is right (driver / PS / trainer)
``rrefs.py``          RRef: owner, local_value, to_here, the proxies, sharing with a third worker
``autograd.py``       distributed autograd: context, backward, get_gradients, A -> B -> C
``optimizer.py``      DistributedOptimizer over parameters owned by two workers
``remote_module.py``  RemoteModule: forward, forward_async, remote_parameters, get_module_rref
``options.py``        num_worker_threads, rpc_timeout and per-call timeouts, a call that times out
``retry.py``          RPC never retries: an application-level retry, and what is safe to retry
``batching.py``       @rpc.functions.async_execution: the chained add, a batch-updating server
``demo.py``           ``python -m tutorial_impl rpc``: every lesson above on local workers

The DDP + RPC tutorial, which builds on the RPC lessons, in reading order:

``hybrid_world.py``  the rank layout (trainers ``0..T-1``, master ``T``, parameter servers
                     after it), names, joining (a gloo group for the trainers, then RPC),
                     leaving; shared with the DDP + RPC benchmark
``hybrid_data.py``   ``get_next_batch``: random bags of random rows
``hybrid_model.py``  ``HybridModel``: a table split over the servers, a DDP-replicated part
``hybrid.py``        the master, ``_run_trainer``, ``run_worker``, the demo

The proofs are in ``tests/rpc/``: ``test_rpc_*.py`` for the reference, ``test_hybrid_*.py``
for the tutorial.
"""
