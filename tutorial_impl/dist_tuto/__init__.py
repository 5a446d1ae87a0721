"""Writing Distributed Applications with PyTorch (shared/seeds/004), in section order.

``run.py``          1. the tutorial's own template: ``init_process``, ``mp.Process``, spawn
``process.py``      1. + 5.1 ``init_process`` grown up: GPU per rank, leaving, ending a worker
``init_methods.py`` 5.2 ``env://``, ``tcp://``, ``file://``
``p2p.py``          2. ``send``/``recv`` and ``isend``/``irecv`` + ``wait``
``collectives.py``  3. ``new_group``, ``all_reduce`` with every ``ReduceOp``, the other collectives
``partition.py``    4.1-4.2 ``Partition``, ``DataPartitioner``, ``partition_dataset``
``data.py``         MNIST (IDX files) or a synthetic MNIST-shaped set: nothing is downloaded
``model.py``        4.3 ``Net``
``sgd.py``          4.3-4.4 ``average_gradients`` and the synchronous SGD loop
``ring.py``         4.5 the hand-written ring ``allreduce`` and a bandwidth-optimal one
"""
