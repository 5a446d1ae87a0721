"""T1. Setup: N processes, one group (the tutorial's 1. Setup and 5.2 Initialization Methods).

The idea. You start the same function once per process, each told its rank and the world
size. ``dist.init_process_group`` makes them meet at a *rendezvous* (an address every one of
them knows) and from then on they are one group: a collective needs every rank of it. The
tutorial's template does exactly that (``init_process``: set the rendezvous address, join,
run ``fn``), and 5.2 names three ways to find the rendezvous: ``env://`` (variables),
``tcp://HOST:PORT`` and ``file://PATH``.

The proof is one all-reduce. Each rank contributes ``rank + 1``; after ``all_reduce`` every
rank must hold 1 + 2 + ... + N. A rank that did not join, or joined another group, cannot
hold that sum, so checking every rank's sum against the closed form checks the group.

Read in this order:

1. The idea, proven: ``init_process`` over three ranks, then each init method.
2. The tutorial's own ``run.py``, spawn and all, as you would run it.
3. The CLI (``python -m tutorial_impl setup``) and its answers to bad input; backends this
   machine may not have (XCCL, MPI, a GPU per NCCL rank), refused clearly; Ctrl-C.
4. At the bottom, how the suite runs ``run.py`` and hosts the rendezvous (machinery: you
   need not read it to follow the lesson).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from tutorial_impl import __main__ as entry
from tutorial_impl.cli import check_backend, launch
from tutorial_impl.dist_tuto import init_methods, p2p
from tutorial_impl.dist_tuto.process import init_process, rank_device, select_gpu
from tutorial_impl.testing import proctable

# ---- The idea: one group, proven by one all-reduce ----------------------------------------


@pytest.mark.world_size(3)
def test_init_process_runs_fn_in_a_group_on_every_rank(run_ranks):
    """The template: ``init_process(rank, size, run)`` in three processes. ``run`` all-reduces
    ``rank + 1``, so all three ranks must now hold 1 + 2 + 3 = 6, and each must know its own
    rank and the world size."""
    # backend=None: the ranks start bare, and init_process makes the group, as in run.py.
    results = run_ranks(init_process, init_methods.run, "gloo", backend=None)
    assert results == [
        {"rank": r, "world_size": 3, "backend": "gloo", "sum": 6.0} for r in range(3)
    ]


@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_each_init_method_forms_a_working_group(run_ranks, tmp_path, kind):
    """The rank calls init_process_group itself with tcp://HOST:PORT or file://."""
    results = run_ranks(init_methods.join_with, kind, str(tmp_path), world_size=3, backend=None)
    assert [r["sum"] for r in results] == [6.0, 6.0, 6.0]
    assert [r["rank"] for r in results] == [0, 1, 2]
    urls = {r["init_method"] for r in results}
    assert len(urls) == 1 and urls.pop().startswith(f"{kind}://")  # one rendezvous for all


@pytest.mark.world_size(3)
def test_env_init_reads_the_variables_the_rank_set(run_ranks):
    """env:// found the group through the variables each rank set itself (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: ``join_through_env_set_here``, below).

    The ranks came from its ``RANK``: harness rank r is group rank 2 - r. The rendezvous
    was at its ``MASTER_PORT``: the store this test hosts on a port the kernel picked held
    no keys before the run, and the group's keys (the ranks' addresses) after it. And the
    group works: every rank's all_reduce of rank + 1 gives 1 + 2 + 3.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert store.num_keys() == 0
    results = run_ranks(join_through_env_set_here, store.port, backend=None)
    assert [r["rank"] for r in results] == [2, 1, 0]
    assert [r["sum"] for r in results] == [6.0, 6.0, 6.0]
    assert {r["init_method"] for r in results} == {"env://"}
    assert store.num_keys() > 0  # the ranks met here, not at the harness's store


# ---- The tutorial's run.py, as written --------------------------------------------------


@pytest.mark.slow
@pytest.mark.warm_world(False)  # run.py sets the process-wide start method to spawn
def test_the_tutorials_run_py_as_written(run_ranks):
    """``run.py`` itself: two spawned interpreters join a group and rank 0's 1.0 reaches rank 1.

    The one test that pays for spawn (each spawned rank is a fresh interpreter that imports
    torch: seconds): every other test starts its ranks through the harness. Of the three
    interpreters a learner's ``python -m tutorial_impl.dist_tuto.run`` starts, the first
    only spawns the ranks and waits for them; here that part of the script runs in a rank
    the harness forked (``run_py_as_a_script``), torch imported already, and the two ranks
    it spawns are fresh interpreters, as the tutorial wrote.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = run_ranks(run_py_as_a_script, store.port, world_size=1, backend=None, timeout=120)
    start_method, exit_codes = results[0]
    assert start_method == "spawn"  # fresh interpreters, not forks of the rank
    assert exit_codes == [0, 0]  # both spawned ranks exited cleanly
    # The tutorial's ``print('Rank ', rank, ' has data ', tensor[0])`` writes its pieces one
    # by one, and both processes share one stdout: the two lines may interleave mid-line
    # ("Rank Rank  0  has data   1 ..."; process.print_line is the cure). So count pieces.
    out = results.outputs[0]
    assert out.count("has data") == 2  # both ranks ran ``run``
    assert out.count("tensor(1.)") == 2  # the sender's 1.0, and the receiver's copy of it
    assert "tensor(0.)" not in out  # the receiver's zeros were overwritten by recv


# ---- Refusals, the harness's option, the launcher and the CLI ---------------------------


def test_a_rank_without_a_gpu_of_its_own_is_refused(monkeypatch):
    """NCCL needs one GPU per rank on a node; wrapping around would share one. Refused,
    naming both counts (a node with 2 GPUs, asked for local rank 2)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"local rank 2 needs its own GPU, .* has 2 GPU\(s\)"):
        select_gpu(2)


def barrier_warnings(rank: int, size: int) -> dict[str, object]:
    """In the group ``init_process`` made: this rank's device, and what ``barrier`` warned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.barrier()
    said = [str(w.message) for w in caught if "barrier()" in str(w.message)]
    return {"device": str(rank_device()), "barrier_warnings": said}


@pytest.mark.dist_gpu(2)
@pytest.mark.world_size(2)
def test_init_process_binds_each_nccl_rank_to_its_own_gpu(run_ranks):
    """NCCL: rank r on ``cuda:r``, its group bound to that GPU (``device_id``), so a barrier
    knows which GPU to use and says nothing (an unbound group's rank 0 would warn
    "barrier(): using the device under current context")."""
    results = run_ranks(init_process, barrier_warnings, "nccl", backend=None)
    assert results == [{"device": f"cuda:{r}", "barrier_warnings": []} for r in range(2)]


@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_harness_init_method_option(run_ranks, kind):
    """The same through the harness (``--init-method`` or ``init_method=``)."""
    results = run_ranks(init_methods.run, init_method=kind)
    assert [r["sum"] for r in results] == [3.0, 3.0]


def test_launch_prints_the_ranks_output_and_returns_their_values(capsys):
    assert launch(p2p.run_blocking, world_size=2) is not None
    out = capsys.readouterr().out.splitlines()
    assert sorted(out) == ["Rank  0  has data  tensor(1.)", "Rank  1  has data  tensor(1.)"]


def test_launch_refuses_bad_input_before_starting_ranks():
    with pytest.raises(ValueError, match=r"unknown backend 'glooo'; choose one of gloo, nccl"):
        launch(init_methods.run, world_size=2, backend="glooo")
    with pytest.raises(ValueError, match=r"--world-size must be at least 1, got 0"):
        launch(init_methods.run, world_size=0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["p2p", "--backend", "glooo"], "unknown backend 'glooo'; choose one of gloo, nccl, mpi"),
        (["ring", "--world-size", "0"], "--world-size must be at least 1, got 0"),
        (["collectives", "--world-size", "1"], "--world-size must be at least 2, got 1"),
        (["setup", "--init-method", "udp"], "invalid choice: 'udp'"),
        (["p2p", "--world-size", "two"], "invalid int value: 'two'"),
    ],
)
def test_cli_messages_for_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        entry.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_unknown_section(capsys):
    assert entry.main(["nosuch"]) == 2
    assert "unknown section 'nosuch'" in capsys.readouterr().err


@pytest.mark.parametrize("section", ["setup", "p2p", "collectives", "ring"])
def test_cli_help(capsys, section):
    with pytest.raises(SystemExit) as exit_info:
        entry.main([section, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert f"python -m tutorial_impl {section}" in out and "--world-size" in out


def test_cli_lists_the_sections(capsys):
    assert entry.main(["--help"]) == 0
    out = capsys.readouterr().out
    for section in ("setup", "p2p", "collectives", "ring"):
        assert f"  {section} " in out


def test_cli_entry_point_in_a_fresh_interpreter():
    """The real command a reader types (``--help`` answers without importing torch)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tutorial_impl", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "  p2p " in proc.stdout and "  ring " in proc.stdout


# ---- XCCL (Intel GPUs): named, and refused with the reason it cannot run here ----


def test_xccl_is_refused_with_its_reason():
    """torch 2.13 knows XCCL (``xpu`` devices' default backend); the demos move tensors to
    the CPU or a CUDA GPU only, and a CPU or CUDA build of torch has no XCCL at all."""
    assert dist.get_default_backend_for_device("xpu") == "xccl"
    why = "the demos place" if dist.is_xccl_available() else "this torch has no XCCL"
    with pytest.raises(ValueError, match=rf"backend 'xccl' \(Intel GPUs\) .*: {why}"):
        check_backend("xccl", 2)


# ---- MPI: only with a torch built with MPI (pip wheels are not) ----


@pytest.mark.skipif(dist.is_mpi_available(), reason="this torch has MPI")
def test_mpi_is_refused_clearly_when_missing():
    with pytest.raises(ValueError, match="backend 'mpi' needs a torch built with MPI"):
        check_backend("mpi", 2)


@pytest.mark.dist_backend("mpi")
@pytest.mark.world_size(1)
def test_mpi_template(run_ranks):
    """The tutorial's MPI variant: ``init_process(0, 0, run, backend='mpi')``; MPI itself
    says who is who (run outside mpirun, that is a world of one)."""
    result = run_ranks(init_process, init_methods.run, "mpi", backend=None)[0]
    assert (
        result["backend"] == "mpi"
        and result["sum"] == result["world_size"] * (result["world_size"] + 1) / 2
    )


@pytest.mark.slow
def test_ctrl_c_stops_a_demo_and_every_rank(run_ranks):
    """Ctrl-C on a running demo: the launcher stops every rank, says so, and exits 130.

    A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the launcher,
    its forkserver and the ranks. We do the same to ``python -m tutorial_impl train`` started
    in a session of its own, once rank 0 has printed its first epoch, and then ask the kernel
    (not the launcher) whether any process of that session is left.

    As with ``run.py`` above, the command's own process is a fork of a rank the harness
    started (``ctrl_c_a_demo_started_in_its_own_session``, below), torch imported already:
    a fresh interpreter would only import it again. Everything the launcher starts is what
    a learner's terminal would see: its forkserver, a fresh interpreter, and the ranks that
    server forks.
    """
    (seen,) = run_ranks(ctrl_c_a_demo_started_in_its_own_session, world_size=1, backend=None)
    assert seen["members_while_training"] >= 3, "launcher, forkserver, ranks"
    assert seen["exit_status"] == 130, seen["err"]
    assert "interrupted; all ranks stopped" in seen["err"]
    assert "Traceback" not in seen["err"]  # one clear line, not the launcher's insides
    assert seen["members_left"] == []


# ---- Machinery: how the suite runs run.py and hosts the rendezvous -----------------------
# The tests above start ranks with the harness (``run_ranks``), which forks them and hands
# each the rendezvous variables. Two of them need more, kept here so the lesson reads first.


def run_py_as_a_script(rank: int, size: int, port: int) -> tuple[str | None, list[int | None]]:
    """``python -m tutorial_impl.dist_tuto.run``, in this rank: run.py's ``__main__`` block, run
    by ``runpy`` as ``-m`` runs it. Returns the start method it chose for its processes and
    the exit status of each process it started.

    The rendezvous is the store the test hosts on a port the kernel picked, handed over as
    torchrun would (``MASTER_PORT`` plus ``TORCHELASTIC_USE_AGENT_STORE``), instead of hoping
    29500 is free; the spawned ranks inherit this environment.
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    os.environ["OMP_NUM_THREADS"] = "1"
    # A fresh interpreter has chosen no start method yet; this rank was given its test
    # process's (which another test may have fixed): back to none, as run.py expects.
    multiprocessing.set_start_method(None, force=True)
    script = runpy.run_module("tutorial_impl.dist_tuto.run", run_name="__main__", alter_sys=True)
    chosen = multiprocessing.get_start_method(allow_none=True)
    return chosen, [p.exitcode for p in script["processes"]]


DEMO = ["train", "--epochs", "50", "--samples", "512"]  # runs far longer than the test waits


def ctrl_c_a_demo_started_in_its_own_session(rank: int, size: int) -> dict[str, object]:
    """``python -m tutorial_impl train`` in a session of its own, Ctrl-C'd once it trains.

    The command is a fork of this rank that leaves its session (``setsid``, what
    ``start_new_session`` does before exec), takes a terminal's default Ctrl-C back
    (background jobs may inherit SIGINT ignored; a terminal's foreground job does not) and
    runs the ``__main__`` block of ``tutorial_impl`` with runpy, as ``-m`` runs it, its
    output to pipes. It starts as a fresh interpreter would: no start method chosen, and no
    rank forkserver (this rank's is the test's, which nested ranks would share), so the
    launcher starts its own, inside the command's session. Its exit status is
    ``sys.exit``'s. What it left behind the kernel tells: the session's live processes.
    (Those orphaned to this rank, a subreaper, are reaped here, as init would.)
    """
    from tutorial_impl.testing.forkserver import server as rank_server

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the command
        code = 1
        try:
            os.setsid()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.argv = ["tutorial_impl", *DEMO]
            # What a fresh interpreter has: no start method chosen, and no rank forkserver
            # yet (this rank's is the test's, which nested ranks would share).
            multiprocessing.set_start_method(None, force=True)
            rank_server.SERVER.__init__()
            runpy.run_module("tutorial_impl", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    seen: dict[str, object] = {}
    members: list[int] = []
    try:
        with open(out_r) as out:
            deadline = time.monotonic() + 60
            for line in out:  # the ranks are training once rank 0 reports an epoch
                if line.startswith("Rank  0 , epoch") or time.monotonic() > deadline:
                    break
            members = proctable.session_members(pid)
            seen["members_while_training"] = len(members)
            with contextlib.suppress(ProcessLookupError):  # gone already: the count says so
                os.killpg(pid, signal.SIGINT)
            out.read()  # to its end: the command and every rank are gone
        with open(err_r) as err:
            seen["err"] = err.read()
        seen["exit_status"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        end = time.monotonic() + 5
        while proctable.session_members(pid) and time.monotonic() < end:
            time.sleep(0.05)
        seen["members_left"] = proctable.session_members(pid)
    finally:
        if proctable.session_members(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for orphan in [pid, *members]:  # handed to this rank when the command exited
            with contextlib.suppress(ChildProcessError):
                os.waitpid(orphan, os.WNOHANG)
    return seen


def join_through_env_set_here(rank: int, size: int, port: int) -> dict[str, object]:
    """``env://``, with every variable it reads set right here, as the template sets them.

    ``init_process_group("gloo", init_method="env://")`` takes no rank and no world size:
    it reads ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE``. The tutorial's
    template sets the first two in ``init_process``; torchrun sets all four. We set all four,
    overwriting what the harness gave this process, and number the ranks backwards
    (``RANK = size - 1 - rank``) so that the group's ranks can only have come from here.
    """
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)  # the store the test hosts, on a port it was given
    # Connect to that store as a client, as torchrun's workers connect to their agent's,
    # instead of rank 0 starting one (the tutorial's rank 0 hosts it on 29500).
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    os.environ["WORLD_SIZE"] = str(size)
    os.environ["RANK"] = str(size - 1 - rank)
    return init_methods.join_with(rank, size, "env", shared_dir="")
