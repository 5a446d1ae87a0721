"""Imported last by the rank forkserver, after every preload: freeze what it has built.

A forked rank shares the forkserver's memory page by page until it *writes* to a page.
CPython writes to an object whenever the garbage collector examines it, so the first full
collection in a rank (a test that allocates a lot triggers one) would copy nearly every page
torch's import filled: over 100 MB per rank. Measured on this 2-core machine, a child of a
torch-loaded process that runs one ``gc.collect()`` costs ~100 ms of CPU; after
``gc.freeze()`` in the parent, ~6 ms, the same as a child that never collects. ``freeze``
moves everything that exists now into a permanent generation the collector never looks at
(what the ``gc`` docs advise for pre-fork servers); objects a rank creates are collected as
usual. The short ranks of the harness benchmark never reach a full collection, so it does
not change their figures.

More things every rank would otherwise do for itself, done once here:

* **Dynamo's caches emptied.** ``init_process_group`` clears ``torch._dynamo``'s trace-rule
  caches whenever dynamo is loaded (the project's suite and any library that compiles load
  it); clearing the forkserver's filled ones in every rank freed objects on some 320 pages
  that the rank then had to copy first: 0.8-1.2 ms of CPU a rank, measured.
* **The ``"faulty"`` backend registered** (``faults.group.register``): a rank registering
  it itself wrote to torch's ``Backend`` tables, pages it then had to copy first: ~0.4 ms of
  CPU a rank, measured. A rank still calls ``register``, which finds it there.
* **Huge pages** (``hugepages``), last: what a fork copies and an exit tears down.
"""

import gc
import sys

from tutorial_impl.testing.faults import group
from tutorial_impl.testing.forkserver import hugepages
from tutorial_impl.testing.strategies.warm import reuse

reuse.classify_loaded()  # which modules are the user's, once, for every warm rank
if "torch._dynamo" in sys.modules:
    try:
        sys.modules["torch._dynamo"].trace_rules.clear_lru_cache()
    except AttributeError:  # moved in a later torch: ranks clear them themselves, as before
        pass
if "torch.distributed" in sys.modules:  # imported by the preload, unless a test removed it
    try:
        group.register()
    except Exception:  # noqa: BLE001 - each rank's own register() raises it, as before
        pass
gc.collect()  # free what the imports left behind, so it is not frozen in with the rest
gc.freeze()
gc.enable()  # off since ``forkserver.boot``: the preload ran without collector passes
hugepages.collapse()
