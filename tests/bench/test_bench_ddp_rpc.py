"""The DDP + RPC benchmark: its batches and model, its command line, small runs end to end.

What the benchmark claims (PyTorch's ``benchmark_ddp_rpc.py``): T trainers, P parameter servers
and a master train the hybrid model (a table per server, an MLP on the trainers); each
trainer's epochs are timed, and a table gives the 50th/75th/90th/95th percentile of the epoch
times per trainer and for all of them, with a throughput next to each.

What this module proves, in reading order: the batches have the shape the options ask for, a
stream per trainer, and the MLP is the original's; the command line refuses what cannot work
before any worker starts, naming the option (a bad ``--json`` path included), and says what
its clock counts; then real workers with small sizes produce the table and the JSON, with
figures only workers that received every option could get right, and a run past
``--timeout`` fails with advice a command-line user can follow. The table's arithmetic is
checked against numpy in ``test_bench_stats.py``.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import torch
from torch.distributed import rpc

from tutorial_impl.bench import ddp_rpc, ddp_rpc_workers, report
from tutorial_impl.rpc.hybrid_data import get_next_batch, trainer_generator
from tutorial_impl.rpc.hybrid_model import mlp

# ---------------------------------------------------------------------------------------
# The batches (the hybrid tutorial's generator, with the benchmark's options)
# ---------------------------------------------------------------------------------------


def test_batches_have_the_requested_shape_and_a_stream_per_trainer():
    def batches(trainer):
        # --num-embeddings 7 --batch-indices 9 9 --bag-size 2 2, three iterations
        g = trainer_generator(0, trainer)
        return list(get_next_batch(g, 3, 7, 8, indices=(9, 9), bag_size=(2, 2)))

    for indices, offsets, target in batches(0):
        # 9 indices in bags of 2: offsets 0, 2, 4, 6, 8 -> 5 bags, one label each.
        assert offsets.tolist() == [0, 2, 4, 6, 8]
        assert len(indices) == 9 and int(indices.min()) >= 0 and int(indices.max()) < 7
        assert len(target) == 5 and int(target.max()) < 8
    # The same trainer gets the same stream again; another trainer another stream.
    same, other = batches(0), batches(1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches(0), same, strict=True))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(same, other, strict=True))
    # Ranges, not constants: bag sizes between 1 and 3 give bags of every size.
    g = trainer_generator(0, 0)
    gaps = [
        d
        for _, offsets, _ in get_next_batch(g, 50, 7, 8, indices=(20, 20), bag_size=(1, 3))
        for d in offsets.diff().tolist()
    ]
    assert set(gaps) == {1, 2, 3}


def test_the_mlp_is_the_originals():
    """PyTorch's benchmark: Linear(512, 256), Linear(256, 128), ReLU, Linear(128, 64),
    Linear(64, 32), Linear(32, 8); here the first layer takes P * dim (8 * 64 = 512)."""
    layers = [
        (type(m).__name__, getattr(m, "in_features", None), getattr(m, "out_features", None))
        for m in mlp(8 * 64)
    ]
    assert layers == [
        ("Linear", 512, 256),
        ("Linear", 256, 128),
        ("ReLU", None, None),
        ("Linear", 128, 64),
        ("Linear", 64, 32),
        ("Linear", 32, 8),
    ]


# ---------------------------------------------------------------------------------------
# End to end: real workers through the CLI
# ---------------------------------------------------------------------------------------


def _run_cli(capsys, tmp_path, *options):
    path = tmp_path / "result.json"
    common = ["--warmup", "1", "--epochs", "2", "--iterations", "3", "--timeout", "60"]
    assert ddp_rpc.main([*common, *options, "--json", str(path)]) == 0
    out = capsys.readouterr()
    return out.out, out.err, json.loads(path.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("trainers", "servers", "dim", "indices", "bag", "bags_per_batch", "optimizer"),
    [
        # 5 indices in bags of 1: 5 samples a batch; the MLP's input is 2 * 3 wide.
        (2, 2, 3, 5, 1, 5, "torchscript"),
        # Asymmetric: 3 trainers, 1 server; 7 indices in bags of 2 -> 4 bags a batch.
        (3, 1, 5, 7, 2, 4, "python"),
    ],
    ids=["2-trainers-2-ps", "3-trainers-1-ps"],
)
def test_small_runs_print_the_table_and_valid_json(
    capsys, tmp_path, monkeypatch, trainers, servers, dim, indices, bag, bags_per_batch, optimizer
):
    # --plot hands the drawing the epoch times of the very rows it printed (the box plot's
    # own drawing is checked in test_bench_stats.py, on the matplotlib worker): a stand-in
    # records the call, so this run imports no matplotlib.
    plots = []
    monkeypatch.setattr(report, "have_matplotlib", lambda: True)
    monkeypatch.setattr(report, "plot_epoch_times", lambda *args: plots.append(args))
    picture = tmp_path / "epochs.png"
    out, err, result = _run_cli(
        capsys,
        tmp_path,
        *("--trainers", str(trainers), "--parameter-servers", str(servers)),
        *("--optimizer", optimizer),
        *("--num-embeddings", "20", "--embedding-dim", str(dim)),
        *("--batch-indices", str(indices), str(indices), "--bag-size", str(bag), str(bag)),
        *("--plot", str(picture)),
    )
    names = [f"Trainer{i}" for i in range(trainers)]
    # The Info section and the table, as the original prints them.
    assert f"PyTorch version: {torch.__version__}" in out
    for name in [*names, "All"]:
        assert f"{name}:" in out
    # Progress went to stderr while the workers ran.
    assert f"all {trainers + servers + 1} workers joined RPC" in err
    assert "warm-up epoch 1/1" in err

    rows = result["rows"]
    assert set(rows) == {*names, "All"}
    # Every trainer saw exactly the batch shape we asked for: 3 iterations x the bags of a
    # batch, over 2 timed epochs. Only workers that received the options can count this.
    per_trainer = 2 * 3 * bags_per_batch
    for name in names:
        row = rows[name]
        assert row["epochs"] == 2 and row["samples"] == per_trainer
        assert 0 < row["p50"] <= row["p75"] <= row["p90"] <= row["p95"] < 30
        assert row["samples_per_s"] == pytest.approx(row["samples"] / row["seconds"])
    everything = rows["All"]
    assert everything["epochs"] == 2 * trainers
    assert everything["samples"] == trainers * per_trainer
    slowest = max(rows[n]["seconds"] for n in names)
    assert everything["samples_per_s"] == pytest.approx(everything["samples"] / slowest)
    assert 0 < result["join_s"] <= result["startup_s"] < result["wall_s"]
    # The printed figures say what they count, and what came before it.
    assert "(counted from the launch of the workers; this process had been running" in out
    assert result["config"]["trainers"] == trainers
    assert f"{servers * dim}-256-128-64-32-8" in out  # the MLP's width followed P * dim
    # One plot, a box per row of the table: each trainer's two timed epochs, and all of them.
    [(epochs, path, title)] = plots
    assert sorted(epochs) == sorted([*names, "All"])
    assert all(len(epochs[name]) == 2 for name in names)
    assert sorted(epochs["All"]) == sorted(t for name in names for t in epochs[name])
    assert path == str(picture) and f"plot written to {picture}" in out
    assert title == f"{trainers} trainers, {servers} PS: epoch times"


@pytest.mark.slow
def test_a_run_past_its_deadline_fails_cleanly(capsys):
    # 1000 epochs cannot finish in 1 s: the harness must stop every worker at the deadline
    # and the CLI must say so and fail, rather than hang or print a half-empty table. The
    # advice names the command's own option, not the test suite's marker. One trainer: the
    # smallest world (3 workers), since every worker computes until the deadline kills it.
    tiny = ["--num-embeddings", "10", "--embedding-dim", "2", "--parameter-servers", "1"]
    code = ddp_rpc.main([*tiny, "--trainers", "1", "--epochs", "1000", "--timeout", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "benchmark failed: still running when the deadline of 1 s passed" in err
    assert "give the run more time with --timeout SECONDS" in err
    assert "rank_timeout" not in err and "--rank-timeout" not in err
    assert "Python stacks of rank" in err  # where each worker was still goes with it


def test_gpu_topology_is_shown_only_where_nvidia_smi_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(report.shutil, "which", lambda name: None)
    assert "nvidia-smi" not in report.info_section()
    # A stand-in nvidia-smi: its output goes under the topology heading...
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU0 X NV2'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(report.shutil, "which", lambda name: str(fake))
    info = report.info_section()
    assert "nvidia-smi topo -m" in info and "GPU0 X NV2" in info
    # ...and a broken one is reported in a line, not raised.
    fake.write_text("#!/bin/sh\nexit 3\n")
    assert "nvidia-smi topo -m failed" in report.info_section()


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if the benchmark gets as far as starting its workers."""

    def refuse(*args, **kwargs):
        raise AssertionError("the workers started before the options were checked")

    monkeypatch.setattr(ddp_rpc, "run_benchmark", refuse)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trainers", "0"], "--trainers must be at least 1, got 0"),
        (["--parameter-servers", "0"], "--parameter-servers must be at least 1, got 0"),
        (["--batch-indices", "0", "3"], "--batch-indices MIN MAX must satisfy 1 <= MIN <= MAX"),
        (["--bag-size", "5", "2"], "--bag-size MIN MAX must satisfy 1 <= MIN <= MAX, got 5 2"),
        (["--rpc-threads", "0"], "--rpc-threads must be at least 1, got 0"),
        (["--rpc-timeout", "0"], "--rpc-timeout must be positive, got 0.0"),
        (["--json", "/no/such/dir/x.json"], "--json /no/such/dir/x.json: there is no directory"),
        (["--json", "/"], "--json /: is a directory, not a file"),
    ],
)
def test_bad_options_are_refused_before_any_worker_starts(no_workers, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        ddp_rpc.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_at_once(no_workers, capsys, monkeypatch):
    monkeypatch.setattr(report, "have_matplotlib", lambda: False)
    with pytest.raises(SystemExit):
        ddp_rpc.main(["--plot", "epochs.png"])
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_every_error_names_an_option_the_parser_has():
    """Errors name a field's option (``flag``); each must be one the parser really has."""
    options = {action.dest: action.option_strings for action in ddp_rpc.build_parser()._actions}
    for field in ddp_rpc_workers.BenchConfig.__dataclass_fields__:
        assert ddp_rpc_workers.flag(field) in options[field], field


def test_the_process_start_is_read_from_the_kernel():
    """The CLI says how long it ran before launching the workers, from the process's start
    as the kernel recorded it: a child started between two readings of the clock must be
    found to have started between them (to a clock tick)."""
    before = time.time()
    child = subprocess.Popen(["sleep", "30"])
    after = time.time()
    try:
        started = report.process_start_time(child.pid)
    finally:
        child.kill()
        child.wait()
    assert started is not None and before - 0.02 <= started <= after + 0.02
    assert report.process_start_time() < before  # this process is older than its child


# The original script's constants (``benchmark_ddp_rpc.py``: NUM_TRAINERS, NUM_PS, NUM_EMBEDDINGS,
# EMBEDDING_DIM, WARMUP_CYCLES, ``range(100 + WARMUP_CYCLES)``, ``range(10)`` batches of
# ``randint(20, 50)`` indices in bags of ``randint(1, 10)``, TensorPipe's default options).
UPSTREAM = {
    "trainers": 8,
    "parameter_servers": 8,
    "num_embeddings": 300,
    "embedding_dim": 64,
    "warmup": 5,
    "epochs": 100,
    "iterations": 10,
    "indices": (20, 50),
    "bag_size": (1, 10),
    "rpc_threads": 16,  # TensorPipeRpcBackendOptions().num_worker_threads
    "rpc_timeout": 60.0,  # TensorPipeRpcBackendOptions().rpc_timeout
}


def test_the_defaults_are_the_originals_and_the_differences_are_named():
    """With no options the benchmark is the original's 8 trainers, 8 parameter servers and a
    master, each option at the original's value; what differs: the MLPs run on the CPU (the
    original puts trainer r on ``cuda:r``), and the batches come from seed 0 (the original
    draws from the unseeded global generator)."""
    options = vars(ddp_rpc.build_parser().parse_args([]))
    defaults = {name: tuple(v) if isinstance(v, list) else v for name, v in options.items()}
    assert {name: defaults[name] for name in UPSTREAM} == UPSTREAM
    tensorpipe = rpc.TensorPipeRpcBackendOptions()
    assert (tensorpipe.num_worker_threads, tensorpipe.rpc_timeout) == (16, 60.0)
    assert ddp_rpc_workers.BenchConfig().world_size == 8 + 8 + 1
    assert (defaults["device"], defaults["seed"]) == ("cpu", 0)
