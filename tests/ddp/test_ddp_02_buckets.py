"""D2. DDP's all-reduces follow ``bucket_cap_mb`` and overlap backward (``ddp/buckets.py``).

The claims: DDP makes one all-reduce per bucket; buckets are filled in the order backward
produces gradients (the reverse of ``model.parameters()`` for a plain stack of layers) until
they reach ``bucket_cap_mb``; and a bucket is reduced as soon as its last gradient exists,
while backward is still computing the others. The lesson's comm hook counts the calls (it
is the only thing that launches them); the expected buckets are computed here, from the
parameters' sizes alone, by ``expected_buckets``: DDP's code is not consulted.

The default is not "25 MiB for every bucket": with ``bucket_cap_mb=None`` the first bucket
is capped at ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB), the rest at 25 MiB; an explicit
cap applies to every bucket. The toy model is far too small to show it, so a test trains
three ``Linear(512, 512)``: 2 buckets by default, 1 with an explicit 25.

Iteration 0 is one bucket, except with ``bucket_cap_mb_list=`` (one cap per bucket): then
DDP buckets the first iteration too, walking ``model.parameters()`` from the first, and
rebuilds in gradient order for the second. And the hook's group: the lesson's hook hands
``allreduce_hook`` its DDP's ``process_group``; ``None`` there would mean the default group,
which two DDP jobs side by side on subgroups of one world would share.

Read in this order:

1. ``expected_buckets`` and ``test_the_reference_rule_on_the_lessons_model``.
2. ``test_all_reduce_count_follows_bucket_cap_mb_and_overlaps_backward``.
3. ``test_the_default_caps_the_first_bucket_at_1_mib``.
4. ``test_a_bucket_cap_mb_list_buckets_the_first_iteration_too``.
5. ``test_the_hook_reduces_over_ddps_group_not_the_world``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.ddp import buckets, toy

pytestmark = pytest.mark.warm_world

MIB = 2**20
# bucket_cap_mb values (DDP multiplies by 2**20 and truncates to bytes; these are exact):
# the default, 4 KiB, 656 bytes (exactly the last three gradients: a bucket closes when it
# *reaches* its cap, so 656 is the value that tells ">=" from ">"), and one byte.
CAPS = [None, 4096 / MIB, 656 / MIB, 1 / MIB]
DEFAULT_CAP_MB = 25  # DDP's documented default, for every bucket but the first
DEFAULT_FIRST_CAP = MIB  # the default's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)
# bucket_cap_mb_list: 16 bytes for the first bucket, 4 KiB for every later one.
CAP_LIST = (16 / MIB, 4096 / MIB)


def fill(params: list[tuple[str, int]], caps: list[int]) -> list[list[str]]:
    """Walk ``(name, bytes)`` in order; close a bucket once it holds its cap in bytes:
    ``caps[k]`` for bucket k, the last cap for every bucket after."""
    found: list[list[str]] = []
    current: list[str] = []
    filled = 0
    for name, size in params:
        current.append(name)
        filled += size
        if filled >= caps[min(len(found), len(caps) - 1)]:
            found.append(current)
            current, filled = [], 0
    if current:
        found.append(current)
    return found


def sizes_in_bytes(model) -> list[tuple[str, int]]:
    return [(name, p.numel() * p.element_size()) for name, p in model.named_parameters()]


def expected_buckets(model, cap_mb: buckets.Cap) -> list[list[str]]:
    """The rebuilt buckets (iteration 1 on) from sizes alone: walk the parameters from last
    to first (the order backward produces their gradients) and ``fill``: with
    ``cap_mb=None``, 1 MiB for the first bucket and 25 MiB for the others; a tuple, its
    caps in order; else ``cap_mb`` for each."""
    if cap_mb is None:
        caps = [DEFAULT_FIRST_CAP, DEFAULT_CAP_MB * MIB]
    else:
        caps = [int(c * MIB) for c in (cap_mb if isinstance(cap_mb, tuple) else (cap_mb,))]
    return fill(sizes_in_bytes(model)[::-1], caps)


def test_the_reference_rule_on_the_lessons_model() -> None:
    """What the rule gives for the lesson's model: 16 + 512 + 128 + 4096 bytes reach 4 KiB
    (the last two layers), 16 + 512 + 128 = 656 fill the 656-byte cap exactly."""
    model = toy.mlp(0)
    assert [len(b) for b in (expected_buckets(model, cap) for cap in CAPS)] == [1, 2, 3, 6]
    assert expected_buckets(model, 4096 / MIB) == [
        ["4.bias", "4.weight", "2.bias", "2.weight"],
        ["0.bias", "0.weight"],
    ]


def test_all_reduce_count_follows_bucket_cap_mb_and_overlaps_backward(run_ranks) -> None:
    """For each cap, two iterations on two ranks, every all-reduce recorded by the hook.

    Iteration 0: one all-reduce of everything (DDP does not yet know the order gradients
    come in). Iteration 1: the buckets ``expected_buckets`` computes, in that order, each
    the size of its gradients. And bucket k's all-reduce starts while exactly the gradients
    of the buckets after it are still missing: backward has not ended for any but the last.
    """
    model = toy.mlp(0)
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    everything = list(sizes)
    results = run_ranks(buckets.buckets_by_cap, CAPS)
    for rank, by_cap in enumerate(results):
        for cap in CAPS:
            first, second = by_cap[cap]
            where = f"rank {rank}, bucket_cap_mb={cap}"
            assert [sorted(c.names) for c in first] == [sorted(everything)], where
            expected = expected_buckets(model, cap)
            assert [c.names for c in second] == expected, where
            assert [c.index for c in second] == list(range(len(expected))), where
            assert [c.numel for c in second] == [sum(sizes[n] for n in b) for b in expected]
            left = len(everything)
            for call in second:
                left -= len(call.names)
                assert call.missing == left, f"{where}: bucket {call.index} saw {call.missing}"
            if len(expected) > 1:  # the overlap, said plainly
                assert second[0].missing > 0, f"{where}: the first all-reduce waited for backward"
    assert results[0] == results[1]  # both ranks bucket alike, or their all-reduces mismatch


def test_the_default_caps_the_first_bucket_at_1_mib(run_ranks) -> None:
    """Three ``Linear(512, 512)``: each weight 1 MiB, each bias 2 KiB. The default closes
    the first bucket at 1 MiB (the last layer: bias, then weight), then 25 MiB takes the
    other two layers; an explicit ``bucket_cap_mb=25`` takes all three in one bucket."""
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == DEFAULT_FIRST_CAP  # the constant torch reads
    wide = toy.mlp(0, buckets.WIDE)
    assert [tuple(p.shape) for p in wide.parameters()] == [(512, 512), (512,)] * 3
    by_default, explicit = expected_buckets(wide, None), expected_buckets(wide, DEFAULT_CAP_MB)
    assert by_default == [["4.bias", "4.weight"], ["2.bias", "2.weight", "0.bias", "0.weight"]]
    assert explicit == [[name for name, _ in reversed(list(wide.named_parameters()))]]
    for by_cap in run_ranks(buckets.buckets_by_cap, [None, DEFAULT_CAP_MB], 2, buckets.WIDE):
        assert [c.names for c in by_cap[None][1]] == by_default  # iteration 1: rebuilt
        assert [c.names for c in by_cap[DEFAULT_CAP_MB][1]] == explicit


def test_a_bucket_cap_mb_list_buckets_the_first_iteration_too(run_ranks) -> None:
    """With ``bucket_cap_mb_list`` DDP does not wait for the real order: iteration 0 fills
    its caps walking ``model.parameters()`` from the *first* (so the 16-byte cap closes on
    the first layer's weight), and reduces the buckets last first; iteration 1 refills them
    in gradient order (so the 16-byte cap now closes on the last layer's bias)."""
    model = toy.mlp(0)
    caps = [int(c * MIB) for c in CAP_LIST]
    first_expected = fill(sizes_in_bytes(model), caps)[::-1]
    assert first_expected == [
        ["2.bias", "4.weight", "4.bias"],
        ["0.bias", "2.weight"],
        ["0.weight"],
    ]
    second_expected = expected_buckets(model, CAP_LIST)
    assert second_expected == [
        ["4.bias"],
        ["4.weight", "2.bias", "2.weight"],
        ["0.bias", "0.weight"],
    ]
    for rank, by_cap in enumerate(run_ranks(buckets.buckets_by_cap, [CAP_LIST])):
        first, second = by_cap[CAP_LIST]
        assert [c.names for c in first] == first_expected, f"rank {rank}: not one bucket"
        assert [c.names for c in second] == second_expected, f"rank {rank}"


def train_in_pairs(rank: int, size: int) -> dict[str, torch.Tensor]:
    """In the ranks: two DDP jobs side by side in one world, ranks {0, 1} and {2, 3}, each
    on its own batch, each DDP over its pair's group, the lesson's hook on each."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    pair, index = divmod(rank, 2)
    try:
        x, y = toy.batch(16, seed=1 + pair)
        ddp, log = buckets.watched_ddp(toy.mlp(0), None, process_group=pairs[pair])
        buckets.train(ddp, log, toy.shard(x, index, 2), toy.shard(y, index, 2), 1)
        return toy.parameters(ddp.module)
    finally:
        for group in pairs:
            dist.destroy_process_group(group)


@pytest.mark.world_size(4)
def test_the_hook_reduces_over_ddps_group_not_the_world(run_ranks) -> None:
    """Each pair must end with one process's step on its own pair's batch. Had the hook
    passed ``None`` (the default group), all four ranks would have averaged together and
    every rank would hold the step on the mean of the two pairs' gradients instead."""
    references = []
    for pair in (0, 1):
        model = toy.mlp(0)
        x, y = toy.batch(16, seed=1 + pair)
        torch.nn.functional.mse_loss(model(x), y).backward()
        toy.plain_sgd_step(model)
        references.append(toy.parameters(model))
    gap = max((references[0][k] - references[1][k]).abs().max() for k in references[0])
    assert gap > 1e-3  # the two pairs' steps differ: a world-wide average would show
    for rank, params in enumerate(run_ranks(train_in_pairs)):
        for name, value in references[rank // 2].items():
            torch.testing.assert_close(params[name], value, atol=1e-6, rtol=0, msg=name)
