"""The Distributed RPC Framework (shared/seeds/003) and Combining DDP with it (000, 001).

The DDP + RPC tutorial, which builds on the RPC lessons:

``hybrid_world.py``  roles (trainers ``0..T-1``, master ``T``, parameter servers after it),
                     names, joining (a gloo group for the trainers, then RPC) and leaving
``hybrid_model.py``  ``HybridModel``: a remote ``EmbeddingBag`` and a DDP-replicated layer
``hybrid.py``        the master, ``_run_trainer``, ``run_worker``, the demo
"""
