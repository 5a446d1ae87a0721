"""Every way into a collective lands on the op a user names, and stays so (``faults.group``).

A fault names a collective by torch.distributed's function name (``op="all_gather_into_tensor"``);
the faulty group sees ``ProcessGroup`` methods (``_allgather_base`` on one torch, then
``all_gather_single``). If a torch release adds a public collective, or routes one through a
method ``faults.group.METHODS`` does not map (or maps to another op), a fault on it would never
fire. So the lists here are derived from the installed torch: every public function of
``torch.distributed`` must be named below, as a collective (with the ops a fault on it counts)
or as something else, and every method of ``ProcessGroup`` too; then one two-rank run calls
each collective in a faulty group and checks the ops it was counted as, and the methods it
reached. A new torch function or method fails here, naming itself.
"""

from __future__ import annotations

import inspect
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tutorial_impl.testing.faults import group as faulty_group
from tutorial_impl.testing.faults import inject as faults
from tutorial_impl.testing.faults import plan as fault_plan

# Every public function is looked at, and every collective called: torch's deprecated names
# among them, whose warnings are expected here.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings(
        "ignore:`torch.distributed.[a-z_]+` (is|will be) deprecated:FutureWarning"
    ),
]

# The public functions that communicate, and the ops a fault counts them as, on rank 0 of two
# (the object collectives are made of plain ones: a fault names those; p2p: rank 0's side).
COLLECTIVES: dict[str, set[str]] = {
    "all_reduce": {"all_reduce"},
    "all_reduce_coalesced": {"all_reduce_coalesced"},
    "all_gather": {"all_gather"},
    "all_gather_coalesced": {"all_gather_coalesced"},
    "all_gather_into_tensor": {"all_gather_into_tensor"},
    "all_gather_single": {"all_gather_into_tensor"},  # torch 2.13's newer name (an alias)
    "all_gather_object": {"all_gather"},
    "all_to_all": {"all_to_all"},
    "all_to_all_single": {"all_to_all_single"},
    "barrier": {"barrier"},
    "broadcast": {"broadcast"},
    "broadcast_object_list": {"broadcast"},
    "gather": {"gather"},
    "gather_object": {"all_gather", "gather"},
    "reduce": {"reduce"},
    "reduce_scatter": {"reduce_scatter"},
    "reduce_scatter_tensor": {"reduce_scatter_tensor"},
    "reduce_scatter_single": {"reduce_scatter_tensor"},  # the newer name (an alias)
    "scatter": {"scatter"},
    "scatter_object_list": {"broadcast", "scatter"},
    "send": {"send"},
    "recv": {"recv"},
    "isend": {"send"},
    "irecv": {"recv"},
    "send_object_list": {"send"},
    "recv_object_list": {"recv"},
    "batch_isend_irecv": {"send", "recv"},
    "monitored_barrier": {"refused"},  # refuses any backend not named "gloo" (docs/faults.md)
}
# The public functions that make, ask about or end groups: no collective of their own.
NOT_COLLECTIVES = set(
    "destroy_process_group get_backend_config get_backend get_default_backend_for_device "
    "get_rank get_world_size get_pg_count init_process_group is_gloo_available is_initialized "
    "is_mpi_available is_backend_available is_nccl_available is_torchelastic_launched "
    "is_ucc_available is_xccl_available new_group new_subgroups new_subgroups_by_enumeration "
    "supports_complex get_debug_level get_group_rank get_global_rank get_process_group_ranks "
    "get_node_local_rank split_group shrink_group record_comm".split()
)
# ProcessGroup's methods that are no collective (its identity, state, backends, making groups).
NOT_COLLECTIVE_METHODS = set(
    "abort bound_device_id boxed get_group_store group_desc group_name merge_remote_group "
    "name rank set_timeout shutdown size split_group unbox use_pg_for_symm_mem_rendezvous "
    "_backend_id _device_types _enable_collectives_timing _end_coalescing _get_backend "
    "_get_backend_name _get_sequence_number_for_group _has_hooks _id _pybind11_conduit_v1_ "
    "_register_backend _register_on_completion_hook _set_default_backend _set_group_desc "
    "_set_group_name _set_sequence_number_for_group _start_coalescing _wait_for_pending_works "
    "monitored_barrier".split()  # dist.monitored_barrier refuses the faulty group before it
)


def test_every_public_function_and_method_of_torch_distributed_is_classified():
    c10d = dist.distributed_c10d
    with warnings.catch_warnings():  # ``reduce_op``, deprecated, warns when looked at
        warnings.simplefilter("ignore", FutureWarning)
        found = {name: getattr(c10d, name) for name in c10d.__all__}
    functions = {n for n, f in found.items() if inspect.isfunction(f) or inspect.isbuiltin(f)}
    new = sorted(functions - set(COLLECTIVES) - NOT_COLLECTIVES)
    gone = sorted((set(COLLECTIVES) | NOT_COLLECTIVES) - functions)
    assert not new, f"torch.distributed functions this test does not know: {new}"
    assert not gone, f"named here, not in this torch: {gone}"
    methods = {m for m in vars(dist.ProcessGroup) if not m.startswith("__")}
    methods = {m for m in methods if callable(getattr(dist.ProcessGroup, m)) or m.startswith("_")}
    methods -= {m for m in methods if isinstance(getattr(dist.ProcessGroup, m), type)}
    unmapped = sorted(methods - set(faulty_group.METHODS) - NOT_COLLECTIVE_METHODS)
    assert not unmapped, f"ProcessGroup methods the faulty group does not intercept: {unmapped}"
    assert set(faulty_group.METHODS) <= methods  # each one torch still has
    assert set(faulty_group.METHODS.values()) <= fault_plan.OPS
    assert {op for ops in COLLECTIVES.values() for op in ops} - {"refused"} <= fault_plan.OPS


def _t(n: int) -> torch.Tensor:
    return torch.ones(n)


def _p2p(rank: int, mine, theirs) -> None:
    (mine if rank == 0 else theirs)()


def _calls(rank: int) -> dict[str, object]:
    """Each collective with arguments a world of two takes (p2p: rank 0 does the named call)."""
    peer = 1 - rank
    root = rank == 0
    pairs = [dist.P2POp(dist.isend, _t(2), peer), dist.P2POp(dist.irecv, _t(2), peer)]
    return {
        "all_reduce": lambda: dist.all_reduce(_t(2)),
        "all_reduce_coalesced": lambda: dist.all_reduce_coalesced([_t(2), _t(3)]),
        "all_gather": lambda: dist.all_gather([_t(2), _t(2)], _t(2)),
        "all_gather_coalesced": lambda: dist.all_gather_coalesced([[_t(2)], [_t(2)]], [_t(2)]),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(_t(4), _t(2)),
        "all_gather_single": lambda: dist.all_gather_single(_t(4), _t(2)),
        "all_gather_object": lambda: dist.all_gather_object([None, None], rank),
        "all_to_all": lambda: dist.all_to_all([_t(1), _t(1)], [_t(1), _t(1)]),
        "all_to_all_single": lambda: dist.all_to_all_single(_t(2), _t(2)),
        "barrier": dist.barrier,
        "broadcast": lambda: dist.broadcast(_t(2), 0),
        "broadcast_object_list": lambda: dist.broadcast_object_list([rank], 0),
        "gather": lambda: dist.gather(_t(2), [_t(2), _t(2)] if root else None, dst=0),
        "gather_object": lambda: dist.gather_object(rank, [None, None] if root else None, dst=0),
        "reduce": lambda: dist.reduce(_t(2), 0),
        "reduce_scatter": lambda: dist.reduce_scatter(_t(2), [_t(2), _t(2)]),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(_t(2), _t(4)),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(_t(2), _t(4)),
        "scatter": lambda: dist.scatter(_t(2), [_t(2), _t(2)] if root else None, src=0),
        "scatter_object_list": lambda: dist.scatter_object_list(
            [None], [1, 2] if root else None, src=0
        ),
        "send": lambda: _p2p(rank, lambda: dist.send(_t(2), 1), lambda: dist.recv(_t(2), 0)),
        "recv": lambda: _p2p(rank, lambda: dist.recv(_t(2), 1), lambda: dist.send(_t(2), 0)),
        "recv from any source": lambda: _p2p(
            rank, lambda: dist.recv(_t(2)), lambda: dist.send(_t(2), 0)
        ),
        "isend": lambda: _p2p(
            rank, lambda: dist.isend(_t(2), 1).wait(), lambda: dist.irecv(_t(2), 0).wait()
        ),
        "irecv": lambda: _p2p(
            rank, lambda: dist.irecv(_t(2), 1).wait(), lambda: dist.isend(_t(2), 0).wait()
        ),
        "send_object_list": lambda: _p2p(
            rank, lambda: dist.send_object_list([1], 1), lambda: dist.recv_object_list([0], 0)
        ),
        "recv_object_list": lambda: _p2p(
            rank, lambda: dist.recv_object_list([0], 1), lambda: dist.send_object_list([1], 0)
        ),
        "batch_isend_irecv": lambda: [w.wait() for w in dist.batch_isend_irecv(pairs)],
        "monitored_barrier": lambda: dist.monitored_barrier(timeout=timedelta(seconds=30)),
    }


def every_collective(rank: int, world_size: int) -> dict[str, tuple[list[str], list[str]]]:
    """Each collective in a faulty group: the ops the injector counted it as, and the
    ProcessGroup methods it reached (each intercepted method spied on, in this rank only)."""
    group_class = faulty_group.group_class()
    reached: list[str] = []
    for method in faulty_group.METHODS:
        original = getattr(group_class, method)

        def spy(self, *args, _method=method, _original=original, **kwargs):
            reached.append(_method)
            return _original(self, *args, **kwargs)

        setattr(group_class, method, spy)
    faulty_group.init_process_group(rank, world_size, (), timeout=timedelta(seconds=30))
    seen = {}
    for name, call in _calls(rank).items():
        before = len(faults.INJECTOR.history)
        reached.clear()
        try:
            call()
        except (RuntimeError, ValueError) as exc:
            assert "gloo" in str(exc).lower() or "backend" in str(exc).lower(), exc
            seen[name] = (["refused"], [])
            continue
        ops = {p.op for p in list(faults.INJECTOR.history)[before:]}
        seen[name] = (sorted(ops), sorted(set(reached)))
    # The groups a user makes by the documented means, on a faulty default group.
    made = [dist.new_group([0, 1]), dist.new_subgroups(2)[0], dist.new_group(backend="faulty")]
    seen["groups made"] = ([dist.get_backend(group) for group in made], [])
    return seen


def test_every_collective_lands_on_the_op_its_user_names(run_ranks):
    seen = run_ranks(every_collective, backend=None, timeout=60)[0]
    assert seen.pop("groups made") == (["faulty"] * 3, [])
    expected = {**COLLECTIVES, "recv from any source": {"recv"}}
    wrong = {n: (ops, expected[n]) for n, (ops, _) in seen.items() if set(ops) != expected[n]}
    assert not wrong, f"counted as (ops, expected): {wrong}"
    methods = {name: m for name, (_, m) in seen.items()}
    # The paths that moved between torch versions, as this torch takes them.
    assert methods["all_gather_into_tensor"] == ["all_gather_single"]
    assert methods["reduce_scatter_tensor"] == ["reduce_scatter_single"]
    assert methods["recv from any source"] == ["recv_anysource"]
    for name, reached in methods.items():  # each method maps to an op the call was counted as
        assert {faulty_group.METHODS[m] for m in reached} == set(seen[name][0]) - {"refused"}
