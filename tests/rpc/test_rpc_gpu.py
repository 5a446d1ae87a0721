"""The reference's CUDA notes, on a GPU (every test is marked ``dist_gpu``: skipped without CUDA).

The reference claims: TensorPipe sends CPU tensors by default; CUDA tensors need a *device
map* in ``TensorPipeRpcBackendOptions`` (``device_maps=`` or ``set_device_map``) that says
where each of the caller's devices lands on the callee, and replies come back through the
inverse map. The reference's warning says RRefs, RemoteModule, distributed autograd and the
distributed optimizer do not support CUDA tensors; for RemoteModule that is stale: torch
2.13 documents ``RemoteModule("worker1/cuda:0", ...)`` (its parameters on that GPU, CPU
inputs moved there before ``forward``), and the test below runs it. For RRefs and
distributed autograd the course keeps the safe pattern: CPU tensors over RPC, moved to the
GPU locally.

One world of three workers on one GPU (``cuda_lesson``): worker0 has a device map to worker1
(cuda:0 -> cuda:0) and none to worker2. Read in order: a CUDA tensor without a map, with a
map, a RemoteModule on worker1's GPU, then the CPU-first pattern for RRefs and distributed
autograd, checked against plain autograd.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn
from torch.distributed.nn import RemoteModule

from tutorial_impl.rpc.workers import (
    filter_expected_warnings,
    init_worker,
    rpc_options,
    shutdown_worker,
    worker_name,
)

RPC_TIMEOUT = 10.0
DEVICE_MAPS = {"worker1": {"cuda:0": "cuda:0"}}  # worker0's cuda:0 lands on worker1's cuda:0


def add_and_report(x: torch.Tensor, k: float) -> tuple[torch.Tensor, str]:
    """Runs on the callee: the sum (sent back) and the device the argument arrived on."""
    return x + k, str(x.device)


def module_state(module_rref: rpc.RRef) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Runs on the RemoteModule's owner: where its weight lives, and CPU copies of it."""
    linear = module_rref.local_value()
    return str(linear.weight.device), linear.weight.detach().cpu(), linear.bias.detach().cpu()


def remote_module_on_a_gpu() -> dict:
    """A ``Linear(3, 2)`` placed on worker1's cuda:0, called with a CPU input."""
    remote = RemoteModule("worker1/cuda:0", nn.Linear, args=(3, 2))
    x = torch.tensor([[1.0, -2.0, 0.5]])
    out = remote(x)  # moved to cuda:0 on worker1; the reply comes back through the map
    device, weight, bias = rpc.rpc_sync("worker1", module_state, args=(remote.get_module_rref(),))
    return {
        "param_device": device,
        "out_device": str(out.device),
        "out": out.cpu(),
        "expected": x @ weight.T + bias,
    }


def cuda_lesson(rank: int, world_size: int) -> dict:
    init_worker(rank, world_size, RPC_TIMEOUT, device_maps=DEVICE_MAPS if rank == 0 else None)
    report: dict = {}
    if rank == 0:
        x = torch.ones(2, device="cuda:0")
        try:
            rpc.rpc_sync("worker2", add_and_report, args=(x, 1.0))
        except RuntimeError as exc:
            report["unmapped_error"] = str(exc)
        total, arrived_on = rpc.rpc_sync("worker1", add_and_report, args=(x, 1.0))
        report["mapped"] = {"arrived_on": arrived_on, "reply_device": str(total.device)}
        report["mapped"]["reply"] = total.cpu()
        report["remote_module"] = remote_module_on_a_gpu()

        # RRef and distributed autograd: CPU tensors over RPC, the GPU only locally.
        w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
        with dist_autograd.context() as context_id:
            remote_sum = rpc.remote("worker2", torch.add, args=(w, 1.0))  # a CPU value
            on_gpu = remote_sum.to_here().to("cuda:0")
            loss = (on_gpu * on_gpu).sum()
            dist_autograd.backward(context_id, [loss])
            report["cpu_first_grad"] = dist_autograd.get_gradients(context_id)[w]
    shutdown_worker(RPC_TIMEOUT)
    return report


@pytest.fixture(scope="module")
def report(rpc_worlds) -> dict:
    return rpc_worlds.run(cuda_lesson, world_size=3, backend=None, timeout=60)[0]


@pytest.mark.dist_gpu(1)
def test_a_cuda_tensor_without_a_device_map_is_refused(report):
    assert "TensorPipe RPC backend only supports CPU tensors by default" in report["unmapped_error"]
    assert "set_device_map" in report["unmapped_error"]


@pytest.mark.dist_gpu(1)
def test_a_device_map_places_the_tensor_and_maps_the_reply_back(report):
    mapped = report["mapped"]
    assert mapped["arrived_on"] == "cuda:0"  # on worker1, as the map says
    assert mapped["reply_device"] == "cuda:0"  # back through the inverse map
    assert torch.equal(mapped["reply"], torch.full((2,), 2.0))


@pytest.mark.dist_gpu(1)
def test_a_remote_module_placed_on_a_gpu_runs_there(report):
    found = report["remote_module"]
    assert found["param_device"] == "cuda:0"  # the module was built on worker1's GPU
    assert found["out_device"] == "cuda:0"  # its output came back through the inverse map
    torch.testing.assert_close(found["out"], found["expected"])  # x @ W.T + b, on the CPU


@pytest.mark.dist_gpu(1)
def test_rrefs_and_dist_autograd_keep_cpu_tensors_and_move_to_the_gpu_locally(report):
    w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    ((w + 1.0) ** 2).sum().backward()  # the same loss, one process, plain autograd
    torch.testing.assert_close(report["cpu_first_grad"], w.grad)
    assert report["cpu_first_grad"].device.type == "cpu"


def set_device_map_lesson(rank: int, world_size: int) -> dict:
    """The same map built the other way: ``set_device_map`` on the options after their
    construction, plus ``devices`` (the devices this worker's TensorPipe agent may use; with
    a map it is inferred, given here explicitly)."""
    filter_expected_warnings()
    options = rpc_options(RPC_TIMEOUT)
    if rank == 0:
        options.set_device_map("worker1", {"cuda:0": "cuda:0"})
        options.set_devices(["cuda:0"])
    rpc.init_rpc(worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
    report: dict = {}
    if rank == 0:
        report["device_maps"] = {
            k: {str(a): str(b) for a, b in v.items()} for k, v in options.device_maps.items()
        }
        report["devices"] = [str(d) for d in options.devices]
        total, arrived_on = rpc.rpc_sync(
            "worker1", add_and_report, args=(torch.ones(2, device="cuda:0"), 1.0)
        )
        report["arrived_on"], report["reply_device"] = arrived_on, str(total.device)
    shutdown_worker(RPC_TIMEOUT)
    return report


@pytest.mark.dist_gpu(1)
def test_set_device_map_and_devices_do_what_device_maps_does(run_ranks):
    report = run_ranks(set_device_map_lesson, world_size=2, backend=None, timeout=60)[0]
    assert report["device_maps"] == {"worker1": {"cuda:0": "cuda:0"}}
    assert report["devices"] == ["cuda:0"]
    assert (report["arrived_on"], report["reply_device"]) == ("cuda:0", "cuda:0")
