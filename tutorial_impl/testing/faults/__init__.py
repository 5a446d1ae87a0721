"""Faults on purpose: the plan's words (``plan``), the injector (``inject``), the faulty group
(``group``); the launcher of a torchrun worker is ``tutorial_impl.testing.fault_launch``.

The exceptions a test meets keep the name they had before the folder (a report's first line
says ``tutorial_impl.testing.faults.InjectedFault``, faults.md shows ``FaultNotFired``), so
they are found here: pickled in a rank, unpickled by that name in the parent.
"""

from tutorial_impl.testing.faults.inject import FaultNotFired, InjectedFault, fault_point

for _cls in (FaultNotFired, InjectedFault):
    _cls.__module__ = __name__

__all__ = ["FaultNotFired", "InjectedFault", "fault_point"]
