"""The hybrid model's batches: random bags of random rows, as in the tutorial and the benchmark.

A batch is ``(indices, offsets, target)``: ``indices`` are rows of the embedding table, cut into
bags where ``offsets`` say (bag b is ``indices[offsets[b]:offsets[b + 1]]``), one label per bag.
The tutorial draws 20 to 50 indices and a new bag every 1 to 10 of them; the benchmark lets
``--batch-indices`` and ``--bag-size`` set those two ranges.

Every generator takes an explicit ``torch.Generator`` (``trainer_generator``): each trainer has a
stream of its own, fixed by the seed, so a test can regenerate the very batches a trainer used.
The tensors stay on the CPU: indices and offsets travel to the parameter servers by RPC.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # indices, offsets, target
INDICES = (20, 50)  # indices in a batch, uniform in [min, max]: the tutorial's
BAG_SIZE = (1, 10)  # indices in a bag, uniform in [min, max]: the tutorial's


def trainer_generator(seed: int, trainer: int) -> torch.Generator:
    """The random stream of one trainer's batches: distinct per trainer, fixed by ``seed``."""
    return torch.Generator().manual_seed(seed * 1_000_003 + trainer)


def random_bags(
    g: torch.Generator,
    num_embeddings: int,
    indices: tuple[int, int] = INDICES,
    bag_size: tuple[int, int] = BAG_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows cut into bags of random sizes: ``(indices, offsets)``."""
    num_indices = int(torch.randint(indices[0], indices[1] + 1, (1,), generator=g))
    rows = torch.randint(0, num_embeddings, (num_indices,), generator=g)
    # The tutorial adds a random bag size to the offset until it passes the end; drawing all
    # sizes at once (never more bags than indices) and keeping the starts before the end is
    # the same process without a Python loop.
    sizes = torch.randint(bag_size[0], bag_size[1] + 1, (num_indices,), generator=g)
    starts = sizes.cumsum(0) - sizes
    return rows, starts[starts < num_indices]


def get_next_batch(
    generator: torch.Generator,
    num_batches: int = 10,
    num_embeddings: int = 100,
    num_classes: int = 8,
    indices: tuple[int, int] = INDICES,
    bag_size: tuple[int, int] = BAG_SIZE,
) -> Iterator[Batch]:
    """The tutorial's batches: random bags of random rows with random labels."""
    for _ in range(num_batches):
        rows, offsets = random_bags(generator, num_embeddings, indices, bag_size)
        target = torch.randint(0, num_classes, (len(offsets),), generator=generator)
        yield rows, offsets, target


def get_learnable_batch(
    generator: torch.Generator,
    num_batches: int = 10,
    num_embeddings: int = 100,
    num_classes: int = 8,
    **shape: tuple[int, int],
) -> Iterator[Batch]:
    """Bags shaped like the tutorial's, but a bag of class ``c`` only holds rows of block ``c``.

    The rows are split into ``num_classes`` blocks; the label is then recoverable from the
    bag's embedding, so training must lower the loss (random labels cannot be learnt).
    ``shape`` takes ``indices`` and ``bag_size``, as ``get_next_batch`` does.
    """
    block = num_embeddings // num_classes
    batches = get_next_batch(generator, num_batches, num_embeddings, num_classes, **shape)
    for rows, offsets, target in batches:
        bag_of_index = torch.bucketize(torch.arange(len(rows)), offsets, right=True) - 1
        within = torch.randint(0, block, (len(rows),), generator=generator)
        yield target[bag_of_index] * block + within, offsets, target


DATASETS: dict[str, Callable[..., Iterator[Batch]]] = {
    "tutorial": get_next_batch,  # random labels, as in the tutorial
    "learnable": get_learnable_batch,  # labels a linear model can learn
}
