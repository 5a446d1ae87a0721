"""The Distributed RPC Framework (shared/seeds/003) and Combining DDP with it (000, 001).

The DDP + RPC tutorial, which builds on the RPC lessons, in reading order:

``hybrid_world.py``  the rank layout (trainers ``0..T-1``, master ``T``, parameter servers
                     after it), names, joining (a gloo group for the trainers, then RPC),
                     leaving; shared with the DDP + RPC benchmark
``hybrid_data.py``   ``get_next_batch``: random bags of random rows
``hybrid_model.py``  ``HybridModel``: a table split over the servers, a DDP-replicated part
``hybrid.py``        the master, ``_run_trainer``, ``run_worker``, the demo
"""
