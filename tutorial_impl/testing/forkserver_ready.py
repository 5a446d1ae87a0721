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
"""

import gc

from tutorial_impl.testing import reuse

reuse.classify_loaded()  # which modules are the user's, once, for every warm rank
gc.collect()  # free what the imports left behind, so it is not frozen in with the rest
gc.freeze()
