"""What the porting guide's ``MultiProcessTestCase`` port imports, for this suite's ranks.

``test_harness_porting`` imports this module, so a rank forkserver that preloads what the test
files import (the plugin's default) imports it once and no rank of that test's runs imports
torch's ``TestCase`` module (a second of CPU) or, at its first ``assertEqual``, ``torch.
distributed.tensor`` (2.5 s) itself, as a ported suite's forkserver would. (This suite turns
that preload off, ``rank_preload_test_imports`` in pyproject.toml: here each such rank imports
it, about 0.25 s of CPU.)

``common_utils`` calls ``torch.backends.disable_global_flags()`` when imported: from then on,
setting a ``torch.backends.cudnn`` flag raises. PyTorch's own suite wants that; this suite's
other tests set those flags in their ranks (``test_harness_reuse``), so it is undone here.
"""

import sys

import torch
import torch.backends
import torch.distributed.tensor  # noqa: F401
import torch.testing._internal.common_utils  # noqa: F401

setattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)  # noqa: B010 - its own name


def has_the_preload(rank: int, world_size: int) -> bool:
    """A rank function: this module is loaded in the rank that runs it."""
    return __name__ in sys.modules
