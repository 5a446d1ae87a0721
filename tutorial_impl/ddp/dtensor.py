"""D7. DeviceMesh and DTensor: one tensor laid out over a 2 x 2 grid of ranks.

FSDP (lesson D6), tensor parallelism and pipeline schedules all describe *where the pieces
of a tensor live* with two objects:

* a ``DeviceMesh`` arranges the ranks in a grid, here 4 ranks as 2 x 2 with named dimensions
  ``("dp", "tp")``: rank ``2 * i + j`` sits at coordinate ``(i, j)``. Each mesh dimension
  has its own process group: ranks that differ only in ``i`` form a "dp" group, ranks that
  differ only in ``j`` a "tp" group. (``init_device_mesh`` creates them, with
  ``new_group``: when you are done with the mesh, destroy them, as ``destroy_mesh_groups``
  does; a mesh over the whole world reuses the default group instead.)
* a ``DTensor`` is a global tensor plus one **placement** per mesh dimension:
  ``Shard(d)`` (cut tensor dim ``d`` into pieces along this mesh dimension, as
  ``torch.chunk`` would), ``Replicate()`` (every rank along it holds the same values) or
  ``Partial()`` (every rank holds an addend; the value is their sum, not yet computed).

``redistribute`` changes placements, and the collective it runs follows from the change:
``Shard -> Replicate`` is an all-gather, ``Partial -> Replicate`` an all-reduce, ``Partial ->
Shard`` a reduce-scatter, ``Shard(0) -> Shard(1)`` an all-to-all, each over the group of the
mesh dimension that changed (on a CPU mesh torch 2.13's DTensor does not call gloo's
all-to-all, which exists: it warns and gathers everything, then keeps its chunk). Ordinary
torch operations on DTensors compute on the local pieces and work out the placement of the
result.

``distribute_tensor`` takes the *whole* tensor on every rank and keeps each rank's piece;
the pieces are cut from rank 0's copy (``src_data_rank=0``), so the ranks need not agree.

    python -m tutorial_impl.ddp.dtensor      # 4 local ranks; or torchrun --nproc-per-node=4
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from tutorial_impl.ddp import toy
from tutorial_impl.dist_tuto.process import print_line

MESH_SHAPE, MESH_DIMS = (2, 2), ("dp", "tp")


def destroy_mesh_groups(mesh: DeviceMesh) -> None:
    """Destroy the process groups ``init_device_mesh`` made for ``mesh`` (not the default),
    and forget the sharding decisions DTensor cached while using it.

    The second part is a torch 2.13 trap: DTensor caches how each operation shards its
    output, keyed by meshes that compare equal when their *layout* is equal, whatever
    their groups. A later 2 x 2 mesh in the same process would be served the cached
    output spec, which still names the old mesh and its destroyed groups: "Could not
    resolve the process group registered under the name 2". ``debug._clear_sharding_prop_cache``
    is torch's own documented way to empty that cache.
    """
    for name in mesh.mesh_dim_names or range(mesh.ndim):
        group = mesh.get_group(name)
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    _clear_sharding_prop_cache()


def whole() -> torch.Tensor:
    """The global tensor of the tour: 4 x 8, every entry its own position."""
    return torch.arange(32.0).reshape(4, 8)


def tour(rank: int, size: int) -> dict:
    """Lay ``whole()`` out over a 2 x 2 mesh in several ways; what this rank holds."""
    if size != 4:
        raise ValueError(f"the 2 x 2 mesh needs 4 ranks, not {size}")
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=MESH_DIMS)
    try:
        seen: dict = {
            "coordinate": tuple(mesh.get_coordinate()),
            "groups": {d: dist.get_process_group_ranks(mesh.get_group(d)) for d in MESH_DIMS},
        }
        # Only rank 0's copy counts: the others pass something else to show it.
        mine = whole() if rank == 0 else whole() + 1000 * rank
        layouts = {
            "shard_shard": [Shard(0), Shard(1)],  # rows over "dp", columns over "tp"
            "shard_replicate": [Shard(0), Replicate()],  # rows over "dp", copies over "tp"
            "replicate": [Replicate(), Replicate()],  # everyone holds all of it
        }
        blocks = {name: distribute_tensor(mine, mesh, pl) for name, pl in layouts.items()}
        seen.update({name: t.to_local().clone() for name, t in blocks.items()})

        grid = blocks["shard_shard"]
        seen["gathered"] = grid.redistribute(mesh, [Replicate(), Replicate()]).to_local()
        swapped = grid.redistribute(mesh, [Shard(1), Shard(0)])  # all-to-all (CPU: gather)
        seen["swapped"] = swapped.to_local().clone()

        # Partial: each rank holds an addend of rank + 1. Reducing over both mesh dims sums
        # all four; over "dp" only, the two ranks of this rank's "dp" group.
        addend = DTensor.from_local(torch.full((2, 2), rank + 1.0), mesh, [Partial(), Partial()])
        seen["sum_all"] = addend.redistribute(mesh, [Replicate(), Replicate()]).to_local()
        over_dp = addend.redistribute(mesh, [Replicate(), Partial()])
        seen["sum_dp"] = (over_dp.placements, over_dp.to_local().clone())

        # Math on DTensors: row-sharded x times a replicated w is row-sharded.
        w = distribute_tensor(torch.ones(8, 3), mesh, [Replicate(), Replicate()])
        product = blocks["shard_replicate"] @ w
        seen["matmul"] = (product.placements, product.full_tensor())
        return seen
    finally:
        destroy_mesh_groups(mesh)


def demo(rank: int, size: int) -> None:
    seen = tour(rank, size)
    print_line(f"rank {rank} at {seen['coordinate']}, groups {seen['groups']}")
    for name in ("shard_shard", "shard_replicate", "swapped"):
        print_line(f"rank {rank} {name}: {seen[name].tolist()}")
    print_line(f"rank {rank} Partial summed over both dims {seen['sum_all'][0, 0].item()}")


def main(argv: list[str] | None = None) -> int:
    args = toy.demo_parser(
        __name__,
        "D7. DeviceMesh and DTensor: Shard, Replicate, Partial and redistribute "
        "on a 2 x 2 mesh of 4 ranks.",
        world_size=None,
    ).parse_args(argv)
    return toy.main(demo, 4, args.timeout, ["torch._dynamo"])


if __name__ == "__main__":
    toy.run_as_script(main)  # the package's copy of this module: see toy.py
