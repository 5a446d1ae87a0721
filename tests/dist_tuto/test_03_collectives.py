"""3. Collective communication (``tutorial_impl/dist_tuto/collectives.py``).

The tutorial claims each collective does what its picture shows: ``all_reduce`` leaves every
rank of a group with the reduction of all inputs under any ``ReduceOp``, ``broadcast`` copies
the source's tensor, ``scatter``/``gather``/``all_gather``/``all_to_all`` move pieces, and a
``new_group`` lets a subset communicate. Every rank starts from an input we can rebuild here
in the parent (``op_input``, ``rank_tensor``), so each expected result is computed
independently, with numpy, from the definitions; every rank returns what it holds and every
rank is checked.

Read in this order:

1. ``test_tutorial_all_reduce_over_a_group``: the tutorial's own 3.1 ``run``.
2. ``reduce_every_op`` + ``test_every_reduce_op_on_gloo``: every op and dtype, against numpy;
   what gloo cannot do is refused with one clear message on every rank.
3. ``gloo_verdicts`` + ``test_supported_ops_table_agrees_with_gloo_itself``: our pre-flight
   table asked of gloo itself, so it cannot drift.
4. ``test_every_collective``: the tour of 3.2, against the definitions.
5. ``coll.run_barrier`` and ``excluding_groups``: what a barrier guarantees; groups that
   leave a rank out.
6. ``test_async_all_reduce_then_wait``: ``async_op=True``, and what ``wait()`` waits for.
7. ``check_op``'s messages, the CLI, then the same on NCCL (skipped without GPUs).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tutorial_impl.dist_tuto import collectives as coll
from tutorial_impl.dist_tuto.collectives import TUTORIAL_OPS, ReduceOp, all_reduce
from tutorial_impl.dist_tuto.process import rank_device

# One warm world serves this lesson's multi-rank tests
# (tutorial_impl/testing/strategies/warm/pool.py):
# each test still runs in a world that is as good as new, checked before reuse.
pytestmark = pytest.mark.warm_world

# The reductions' definitions, written independently of torch.distributed.
NUMPY_REDUCTIONS = {
    "SUM": lambda xs: np.sum(xs, axis=0),
    "PRODUCT": lambda xs: np.prod(xs, axis=0),
    "MIN": lambda xs: np.min(xs, axis=0),
    "MAX": lambda xs: np.max(xs, axis=0),
    "AVG": lambda xs: np.mean(xs, axis=0),
    "BAND": lambda xs: functools.reduce(np.bitwise_and, xs),
    "BOR": lambda xs: functools.reduce(np.bitwise_or, xs),
    "BXOR": lambda xs: functools.reduce(np.bitwise_xor, xs),
    "PREMUL_SUM": lambda xs: np.sum(xs, axis=0) * 0.5,  # every input times 0.5, then summed
}


def op_input(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input for the ReduceOp tests: small values with varied bit patterns."""
    values = [rank + 1, 10 ^ rank, 6 | (rank << 2), 12 - 3 * rank, (7 * rank) % 5 - 2]
    t = torch.tensor(values, dtype=torch.int64)
    if dtype.is_floating_point:
        return t.to(dtype) / 2  # halves: exact in binary, and PRODUCT stays small
    return t.to(dtype)


def numpy_inputs(world_size: int, dtype: torch.dtype) -> np.ndarray:
    return np.stack([op_input(r, dtype).numpy() for r in range(world_size)])


@pytest.mark.parametrize("world_size", [2, 3])
def test_tutorial_all_reduce_over_a_group(run_ranks, world_size):
    """The tutorial's ``run``: ranks 0 and 1 sum their ones; a third rank is not in the
    group and keeps its 1.0 (yet it too had to call ``new_group``)."""
    results = run_ranks(coll.run, world_size=world_size)
    assert [t.item() for t in results] == [2.0, 2.0, 1.0][:world_size]
    assert "Rank  0  has data  tensor(2.)" in results.outputs[0].splitlines()
    assert "Rank  1  has data  tensor(2.)" in results.outputs[1].splitlines()


def reduce_every_op(rank: int, size: int, dtypes: list[torch.dtype]) -> dict[str, object]:
    """All-reduce ``op_input`` with every op and dtype: the result, or the error's message."""
    results: dict[str, object] = {}
    for name in (*TUTORIAL_OPS, "AVG"):
        for dtype in dtypes:
            tensor = op_input(rank, dtype).to(rank_device())
            try:
                all_reduce(tensor, getattr(ReduceOp, name), premul_factor=0.5)
                results[f"{name}/{dtype}"] = tensor.cpu()
            except ValueError as exc:
                results[f"{name}/{dtype}"] = str(exc)
    return results


@pytest.mark.world_size(3)
def test_every_reduce_op_on_gloo(run_ranks):
    """Each op of the tutorial's list, on floats and integers, against numpy.

    What gloo cannot do must fail with our message naming op, dtype or backend: bitwise ops
    on floats, AVG on integers, PREMUL_SUM at all (NCCL only).
    """
    dtypes = [torch.float32, torch.int64]
    results = run_ranks(reduce_every_op, dtypes)
    assert results[0].keys() == results[1].keys() == results[2].keys()
    expected_errors = {
        "PREMUL_SUM/torch.float32": "ReduceOp.PREMUL_SUM is not supported by the gloo backend",
        "PREMUL_SUM/torch.int64": "ReduceOp.PREMUL_SUM is not supported by the gloo backend",
        "BAND/torch.float32": "ReduceOp.BAND needs an integer or bool tensor, got torch.float32",
        "BOR/torch.float32": "ReduceOp.BOR needs an integer or bool tensor",
        "BXOR/torch.float32": "ReduceOp.BXOR needs an integer or bool tensor",
        "AVG/torch.int64": "ReduceOp.AVG on gloo needs a floating-point tensor, got torch.int64",
    }
    checked = 0
    for dtype in dtypes:
        inputs = numpy_inputs(3, dtype)
        for name in NUMPY_REDUCTIONS:
            key = f"{name}/{dtype}"
            for rank in range(3):
                got = results[rank][key]
                if key in expected_errors:
                    assert isinstance(got, str) and expected_errors[key] in got
                    continue
                want = NUMPY_REDUCTIONS[name](inputs)
                assert got.dtype == dtype
                np.testing.assert_array_equal(got.numpy(), want.astype(got.numpy().dtype))
                checked += 1
    assert checked == 3 * (
        2 * len(NUMPY_REDUCTIONS) - len(expected_errors)
    )  # nothing was silently skipped
    assert "(it is NCCL-only)" in results[0]["PREMUL_SUM/torch.float32"]


def gloo_verdicts(rank: int, size: int) -> dict[str, str]:
    """What gloo itself answers to each op and dtype, without our check in front.

    Keeps ``SUPPORTED_OPS`` honest: the tests compare these verdicts with ``check_op``'s.
    Every rank meets the same verdict, so nothing hangs; but not every refusal comes before
    the data moves: AVG on integers runs the sum, then fails to divide in place (an integer
    tensor cannot hold the float mean), leaving the *sum* in the tensor. So the tensor after
    each failure is recorded too.
    """
    verdicts = {}
    for name in (*TUTORIAL_OPS, "AVG"):
        for dtype in (torch.float32, torch.int64):
            op = getattr(ReduceOp, name)
            if name == "PREMUL_SUM":
                op = dist._make_nccl_premul_sum(0.5)
            tensor = op_input(rank, dtype)
            try:
                dist.all_reduce(tensor, op=op)
                verdicts[f"{name}/{dtype}"] = "ok"
            except (RuntimeError, ValueError, TypeError) as exc:
                verdicts[f"{name}/{dtype}"] = f"error: {exc}"
                verdicts[f"{name}/{dtype} left"] = tensor.tolist()
    return verdicts


def test_supported_ops_table_agrees_with_gloo_itself(run_ranks):
    """Our pre-flight check refuses exactly what gloo refuses, nothing more and nothing less."""
    results = run_ranks(gloo_verdicts)
    verdicts = results[0]
    left = {key: verdicts.pop(key) for key in list(verdicts) if key.endswith(" left")}
    for other in results[1:]:  # every rank meets the same verdict (its leftovers differ)
        assert {k: v for k, v in other.items() if not k.endswith(" left")} == verdicts
    for key, verdict in verdicts.items():
        name, dtype_name = key.split("/")
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        try:
            coll.check_op(getattr(ReduceOp, name), dtype, "gloo")
            ours = "ok"
        except ValueError:
            ours = "error"
        assert verdict.split(":")[0] == ours, (key, verdict)
    assert "Cannot use ReduceOp.PREMUL_SUM with Gloo" in verdicts["PREMUL_SUM/torch.float32"]
    # AVG on integers failed *after* the data moved: the tensor holds the sum of the inputs.
    inputs = [op_input(r, torch.int64) for r in range(2)]
    assert verdicts["AVG/torch.int64"].startswith("error: result type Float can't be cast")
    assert left["AVG/torch.int64 left"] == (inputs[0] + inputs[1]).tolist()
    # PREMUL_SUM is refused before anything moves: the input is untouched.
    assert left["PREMUL_SUM/torch.float32 left"] == op_input(0, torch.float32).tolist()


def expected_tour(world_size: int) -> list[dict[str, np.ndarray | None]]:
    """What each rank must hold after ``tour``, from the definitions of the collectives."""
    x = [coll.rank_tensor(r).numpy() for r in range(world_size)]
    src = world_size - 1
    out = []
    for r in range(world_size):
        out.append(
            {
                "broadcast": x[src],
                "reduce": np.sum(x, axis=0) if r == src else None,
                "scatter": np.full(2, 10.0 * r + 1),
                "gather": np.stack(x) if r == src else None,
                "all_gather": np.stack(x),
                "all_to_all": np.array([100.0 * j + r for j in range(world_size)]),
                "reduce_scatter": np.sum([xj + r for xj in x], axis=0),
            }
        )
    return out


def check_tour(results, world_size: int) -> None:
    for rank, (got, want) in enumerate(zip(results, expected_tour(world_size), strict=True)):
        assert got.keys() == want.keys()
        for name, value in want.items():
            if value is None:
                assert got[name] is None, (rank, name)
            else:
                np.testing.assert_array_equal(got[name].numpy(), value, err_msg=f"{rank} {name}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_collective(run_ranks, world_size):
    results = run_ranks(coll.tour, world_size=world_size, fn_kwargs={"verbose": False})
    check_tour(results, world_size)


@pytest.mark.world_size(3)
def test_barrier_waits_for_the_slowest_rank(run_ranks, tmp_path):
    """Rank 0 sleeps 0.2 s before it leaves its file, rank 1 0.1 s, rank 2 not at all.
    After the barrier every rank, the fast ones included, must already see all three files."""
    arrivals = tmp_path / "arrivals"
    arrivals.mkdir()
    seen = run_ranks(coll.run_barrier, str(arrivals))
    assert seen == [["arrived-0", "arrived-1", "arrived-2"]] * 3


def excluding_groups(rank: int, size: int) -> dict[str, object]:
    """Two groups that each leave a rank out: A = [0, 2] and B = [1, 2] (world size 3).

    Every rank calls ``new_group`` for both, in the same order, even for a group it is not
    in; that is how the ranks agree on the group's identity. A rank outside a group gets
    ``GroupMember.NON_GROUP_MEMBER``, and asked its rank in that group, torch answers -1.
    """
    group_a, group_b = dist.new_group([0, 2]), dist.new_group([1, 2])
    out: dict[str, object] = {
        "rank_in_a": dist.get_rank(group_a),  # torch's answer, -1 for an outsider
        "a_is_member": group_a != dist.GroupMember.NON_GROUP_MEMBER,
        "b_is_member": group_b != dist.GroupMember.NON_GROUP_MEMBER,
    }
    for name, group, members in (("a", group_a, (0, 2)), ("b", group_b, (1, 2))):
        t = torch.tensor([float(rank + 1)], device=rank_device())
        if rank in members:
            all_reduce(t, ReduceOp.SUM, group=group)
            # src is a *global* rank: rank 2 sends its list to the other member of the group.
            payload = [f"hello from rank {rank} in group {name}"]
            dist.broadcast_object_list(payload, src=2, group=group)
            out[f"{name}_message"] = payload[0]
        out[f"{name}_sum"] = t.item()
    return out


@pytest.mark.world_size(3)
def test_groups_that_exclude_a_rank(run_ranks):
    r0, r1, r2 = run_ranks(excluding_groups)
    # Group A = [0, 2]: 1 + 3; group B = [1, 2]: 2 + 3. Outsiders keep their own rank + 1.
    assert (r0["a_sum"], r1["a_sum"], r2["a_sum"]) == (4.0, 2.0, 4.0)
    assert (r0["b_sum"], r1["b_sum"], r2["b_sum"]) == (1.0, 5.0, 5.0)
    assert (r0["a_is_member"], r1["a_is_member"], r2["a_is_member"]) == (True, False, True)
    assert (r0["b_is_member"], r1["b_is_member"], r2["b_is_member"]) == (False, True, True)
    # Group ranks are renumbered from 0: global rank 2 is rank 1 of group A; rank 1, outside
    # it, has none (torch says -1).
    assert (r0["rank_in_a"], r1["rank_in_a"], r2["rank_in_a"]) == (0, -1, 1)
    # broadcast's src is a global rank; only the members received rank 2's message.
    assert r0["a_message"] == r2["a_message"] == "hello from rank 2 in group a"
    assert r1["b_message"] == r2["b_message"] == "hello from rank 2 in group b"
    assert "a_message" not in r1 and "b_message" not in r0


def test_check_op_messages_name_op_dtype_and_backend():
    with pytest.raises(ValueError, match=r"ReduceOp.PREMUL_SUM is not supported by the gloo"):
        coll.check_op(ReduceOp.PREMUL_SUM, torch.float32, "gloo")
    with pytest.raises(ValueError, match=r"ReduceOp.BXOR is not supported by the nccl backend"):
        coll.check_op(ReduceOp.BXOR, torch.int64, "nccl")
    coll.check_op(ReduceOp.PREMUL_SUM, torch.float32, "nccl")  # NCCL has it
    with pytest.raises(
        ValueError, match=r"PREMUL_SUM needs a floating-point tensor, got torch.int64"
    ):
        coll.check_op(ReduceOp.PREMUL_SUM, torch.int64, "nccl")  # NCCL: floating types only


@pytest.mark.parametrize("world_size", [2, 3])
def test_async_all_reduce_then_wait(run_ranks, world_size):
    """``async_op=True``, ``wait()``, then doubling: every rank holds twice 1 + ... + N."""
    twice_the_sum = world_size * (world_size + 1)  # 2 * (1 + 2 + ... + N)
    results = run_ranks(coll.run_async_all_reduce, world_size=world_size)
    assert results == [[float(twice_the_sum)] * 4] * world_size


@pytest.mark.dist_gpu(2)
@pytest.mark.dist_backend("nccl")
def test_async_all_reduce_then_wait_on_nccl(run_ranks):
    """On NCCL ``wait()`` orders the GPU's streams, not the CPU: the doubling still comes
    after the sum, 2 * (1 + 2) on both GPUs."""
    assert run_ranks(coll.run_async_all_reduce) == [[6.0] * 4, [6.0] * 4]


def gloo_all_reduce_on_gpus(rank: int, size: int) -> tuple[str, float]:
    """The tutorial: gloo runs all-reduce on CUDA tensors too (not just on the CPU)."""
    t = torch.tensor([rank + 1.0], device=f"cuda:{rank}")  # each rank on its own GPU
    dist.all_reduce(t)  # the default group is gloo here
    return t.device.type, t.item()


@pytest.mark.dist_gpu(2)
def test_gloo_all_reduces_cuda_tensors(run_ranks):
    assert run_ranks(gloo_all_reduce_on_gpus) == [("cuda", 3.0), ("cuda", 3.0)]


# NCCL's reductions, from its documentation (ncclRedOp_t: ncclSum, ncclProd, ncclMax,
# ncclMin, ncclAvg, and ncclRedOpCreatePreMulSum): no bitwise ones. Written out here, apart
# from SUPPORTED_OPS, so that a wrong entry in the table fails on a CPU machine too.
NCCL_REDUCTIONS = {"SUM", "PRODUCT", "MAX", "MIN", "AVG", "PREMUL_SUM"}


def test_check_op_knows_nccls_reductions():
    """Every ReduceOp against NCCL, on a dtype it suits: accepted exactly when NCCL has it."""
    accepted = set()
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM", "BAND", "BOR", "BXOR"):
        dtype = torch.int64 if name.startswith("B") else torch.float32
        try:
            coll.check_op(getattr(ReduceOp, name), dtype, "nccl")
            accepted.add(name)
        except ValueError as exc:
            assert f"ReduceOp.{name} is not supported by the nccl backend" in str(exc)
    assert accepted == NCCL_REDUCTIONS


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_check_op_refuses_what_no_backend_reduces(backend):
    """8-bit floats reduce on neither backend, and AVG of bools means nothing: both are
    refused before any communication, with the same ValueError on every rank (NCCL itself
    would raise a TypeError or RuntimeError from inside the call, gloo 'Invalid scalar type')."""
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for name in ("SUM", "MAX"):
            with pytest.raises(ValueError, match=rf"ReduceOp.{name} on {dtype}: {backend} cannot"):
                coll.check_op(getattr(ReduceOp, name), dtype, backend)
    with pytest.raises(ValueError, match="ReduceOp.AVG"):
        coll.check_op(ReduceOp.AVG, torch.bool, backend)
    coll.check_op(ReduceOp.SUM, torch.bfloat16, backend)  # a 16-bit float is fine on both
    coll.check_op(ReduceOp.MAX, torch.bool, backend)


def test_cli_demo(capsys):
    assert coll.main(["--world-size", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "Rank  0  has data  tensor(2.)" in out and "Rank  1  has data  tensor(2.)" in out
    assert "Rank  0  all_to_all: [0.0, 100.0]" in out
    assert "Rank  1  after the barrier sees 2 of 2 arrivals" in out


# ---- the same on NCCL with CUDA tensors (skipped at collection time without 2 GPUs) ----


@pytest.mark.dist_gpu(2)
@pytest.mark.dist_backend("nccl")
def test_every_collective_on_nccl(run_ranks):
    check_tour(run_ranks(coll.tour, fn_kwargs={"verbose": False}), 2)


@pytest.mark.dist_gpu(2)
@pytest.mark.dist_backend("nccl")
def test_reduce_ops_on_nccl(run_ranks):
    """NCCL has PREMUL_SUM (floating types only) and AVG, but no bitwise ops."""
    results = run_ranks(reduce_every_op, [torch.float32])
    inputs = numpy_inputs(2, torch.float32)
    for rank in range(2):
        for name in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"):
            got = results[rank][f"{name}/torch.float32"]
            np.testing.assert_allclose(got.numpy(), NUMPY_REDUCTIONS[name](inputs), rtol=1e-6)
        assert "not supported by the nccl backend" in results[rank]["BAND/torch.float32"]
