"""The Ray executor and plfl sweep --parallel: the same results as sequential, dead actors replaced, clear errors.

One local Ray of 2 CPUs serves the module (``local_ray``). The head node started apart is stopped by its process
group, not by ``ray stop``, which would stop every Ray on the machine (another test worker's among them).
"""

import csv
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from plfl.cli import main
from plfl.config import load_config, resume_config
from plfl.data import FederatedData
from plfl.errors import ConfigError
from plfl.executors.options import ClientWorkOptions, Ray
from plfl.executors.ray_actors import ClientWorker, RayExecutor
from plfl.experiment import run_experiment
from plfl.sections import TrainerConfig
from plfl.sweep import run_sweep
from plfl.tasks import ClientFailure, TrainTask

from conftest import FAST_METHODS, make_context, matrix_config, run_results, sequential
from test_sweep import write_sweep

ray = pytest.importorskip("ray")


ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
RAY = str(Path(sys.executable).parent / "ray")  # the command-line tool of this environment's Ray
FAULTS = "PLFL_TEST_FAULTS"  # a folder the fault-injecting workers mark their first death in


def rows(path: Path, drop=("seconds",)) -> list[dict[str, str]]:
    """A CSV's rows without the wall-clock columns: everything else must match exactly."""
    with open(path) as f:
        return [{k: v for k, v in row.items() if k not in drop} for row in csv.DictReader(f)]


def results(run_dir: Path) -> tuple:
    return rows(run_dir / "metrics.csv"), rows(run_dir / "clients.csv")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(tmp_path: Path, rounds: int, **sections: str) -> Path:
    """A config file of 5 digits clients, MLP, ``rounds`` rounds, output in tmp_path; extra sections as YAML."""
    config = tmp_path / "run.yaml"
    config.write_text(
        f"output_dir: {tmp_path}\nprogress_bar: false\n"
        "data: {source: digits, num_clients: 5, beta: 0.5}\nmodel: {name: mlp, hidden_sizes: [32]}\n"
        f"federation: {{rounds: {rounds}, lr: 0.05, batch_size: 20, executor: ray}}\n"
        + "".join(f"{k}: {v}\n" for k, v in sections.items())
    )
    return config


def environment(**extra: str) -> dict[str, str]:
    """This process's environment with this checkout (and the tests, for the workers below) importable first."""
    path = [str(ROOT), str(TESTS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "WANDB_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        **extra,
    }  # one thread: see conftest.py


def plfl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "plfl", *args], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env
    )


def stop_process_group(group: int, grace: float = 10.0) -> None:
    """SIGTERM every process of ``group``, then SIGKILL those left after ``grace`` seconds (``ray stop``'s way, for
    one cluster only)."""
    try:
        os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            os.killpg(group, 0)  # ProcessLookupError once the group is empty
            time.sleep(0.2)
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_a_federation_runs_on_a_ray_head_node_started_apart(tmp_path, digits_config):
    port, token = free_port(), secrets.token_hex(32)
    # A cluster as its user starts it, with token authentication (RAY_AUTH_TOKEN instead of ~/.ray/auth_token).
    env = environment(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    with tempfile.TemporaryDirectory(prefix="plfl-ray-") as temp_dir:  # short: Ray's socket paths have a limit
        head = subprocess.Popen(
            [
                RAY,
                "start",
                "--head",
                "--num-cpus",
                "2",
                "--port",
                str(port),
                "--temp-dir",
                temp_dir,
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
            start_new_session=True,  # the head's processes keep this group; its workers end with its raylet
        )
        try:
            _, err = head.communicate(timeout=300)
            assert head.returncode == 0, err
            config = tiny_config(tmp_path, 3, ray="{address: auto}")
            out = plfl("fit", "--config", str(config), env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"})
            assert out.returncode == 0, out.stderr
            assert "Connected to Ray cluster" in out.stderr
        finally:
            stop_process_group(head.pid)
    on_cluster = Path(out.stdout.strip().splitlines()[-1].removeprefix("Run directory: "))
    sequential, _ = run_experiment(digits_config())
    assert results(on_cluster) == results(sequential)


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    """One local Ray of 2 CPUs for the module; its workers import this checkout and these tests."""
    os.environ[FAULTS] = str(tmp_path_factory.mktemp("faults"))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = environment()["PYTHONPATH"]
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()
    os.environ.pop(FAULTS)
    if saved is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = saved


@pytest.mark.slow
@pytest.mark.parametrize("method", FAST_METHODS)
def test_ray_runs_methods_as_sequential(local_ray, tmp_path, sequential_results, monkeypatch, method):
    """Each kind of client work (plain and momentum SGD, a method's steps on features an epoch at a time, bi-level
    steps, evaluation) on 2 Ray actors: the sequential executor's metrics, per-client results and final models,
    bit for bit; the data go into the object store once per run. Every method's tasks and results pickled as an
    actor's are tested without Ray, with the vectorized executor's matrix (tests/test_executors.py)."""
    puts = []
    put = ray.put
    monkeypatch.setattr(ray, "put", lambda value, **kw: puts.append(type(value)) or put(value, **kw))
    run_dir, _ = run_experiment(matrix_config(tmp_path, method, "ray"))
    assert puts.count(FederatedData) == 1  # not per round
    metrics, clients, models = run_results(run_dir)
    expected_metrics, expected_clients, expected_models = sequential_results(method)
    assert (metrics, clients) == (expected_metrics, expected_clients)
    for one, other in zip(models, expected_models, strict=True):
        assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


@pytest.mark.slow
def test_local_steps_train_on_ray_as_on_the_sequential_executor(local_ray, tmp_path):
    """federation.local_steps (Ditto: the global copy's steps, then its personal epoch), bit for bit."""
    (sequential_run, ray_run) = (
        run_results(run_experiment(matrix_config(tmp_path / e, "ditto", e, **{"federation.local_steps": 3}))[0])
        for e in ("sequential", "ray")
    )
    assert sequential_run[:2] == ray_run[:2]
    for one, other in zip(sequential_run[2], ray_run[2], strict=True):
        assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


@pytest.mark.slow
def test_sample_level_dp_trains_on_ray_as_on_the_sequential_executor(local_ray, tmp_path):
    """DP-SGD (Opacus in each actor), its noise from each training's seed: bit for bit, ε per client included."""
    options = {"privacy.level": "sample", "privacy.noise_multiplier": 0.8}
    (sequential_run, ray_run) = (
        run_results(run_experiment(matrix_config(tmp_path / e, "ditto", e, **options))[0])
        for e in ("sequential", "ray")
    )
    assert sequential_run[:2] == ray_run[:2] and "epsilon" in ray_run[1][0]
    for one, other in zip(sequential_run[2], ray_run[2], strict=True):
        assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


@pytest.mark.slow
def test_unseen_clients_and_partial_work_run_on_ray_as_on_the_sequential_executor(local_ray, tmp_path):
    """Unseen clients fine-tuned and tested, stragglers cut to partial work, some dropped: bit for bit."""
    keys = {
        "federation.unseen_clients": 1,
        "eval.finetune_epochs": 1,
        "federation.system.sample_seconds": 0.001,
        "federation.system.compute_spread": 1.0,
        "federation.system.deadline": 0.05,
        "federation.system.late": "partial",
        "federation.system.dropout": 0.3,
    }
    (sequential_run, ray_run) = (
        run_experiment(matrix_config(tmp_path / e, "fedavg", e, **keys))[0] for e in ("sequential", "ray")
    )
    for name in ("metrics.csv", "clients.csv", "tables/unseen_clients.csv", "tables/system_clients.csv"):
        assert rows(ray_run / name) == rows(sequential_run / name), name
    assert any(row["status"] == "partial" for row in rows(ray_run / "tables/system_clients.csv"))


@pytest.mark.slow
def test_a_backdoor_under_a_robust_rule_runs_on_ray_as_on_the_sequential_executor(local_ray, tmp_path):
    """Poisoned training images on the actors, triggered test images as extra clients, the trimmed mean: bit for
    bit, the backdoor's success included (upload attacks change the uploads on the server, whatever the executor)."""
    keys = {"attack.kind": "backdoor", "attack.fraction": 0.4, "aggregation.rule": "trimmed_mean"}
    (sequential_run, ray_run) = (
        run_experiment(matrix_config(tmp_path / e, "fedavg", e, **keys))[0] for e in ("sequential", "ray")
    )
    for name in ("metrics.csv", "clients.csv"):
        assert rows(ray_run / name) == rows(sequential_run / name), name
    assert rows(ray_run / "metrics.csv")[-1]["backdoor_success"]


class DiesOnce(ClientWorker):
    """Exits its process the first time any actor is asked to train client 2 (marked in the FAULTS folder)."""

    def train(self, task):
        mark = Path(os.environ[FAULTS]) / "client-2-died"
        if task.client_id == 2 and not mark.exists():
            mark.touch()
            os._exit(1)
        return super().train(task)


class Faulty(ClientWorker):
    """Client 1's training always kills its actor; client 3's raises a PlflError, as bad options would."""

    def train(self, task):
        if task.client_id == 1:
            os._exit(1)
        if task.client_id == 3:
            raise ConfigError("bad option; fix it")
        return super().train(task)


@pytest.mark.slow
def test_an_actor_that_dies_mid_round_is_replaced_and_the_run_resumes_on_ray(local_ray, digits_config, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(RayExecutor, "worker", DiesOnce)
        first, summary = run_experiment(digits_config(**{"federation.executor": "ray", "federation.rounds": 2}))
    assert (Path(os.environ[FAULTS]) / "client-2-died").exists()  # in round 1, with clients 0 and 1 trained
    assert summary["client_failures"] == []  # its retry succeeded
    resumed, _ = run_experiment(resume_config(first, ["federation.rounds=3"]), first)
    assert resumed == first
    sequential, _ = run_experiment(digits_config())
    assert results(resumed) == results(sequential)


@pytest.mark.slow
def test_a_second_death_fails_the_client_and_a_plfl_error_reaches_the_driver(local_ray, tiny_federation, monkeypatch):
    monkeypatch.setattr(RayExecutor, "worker", Faulty)
    context, model = make_context(tiny_federation)
    work = ClientWorkOptions(context.federation, TrainerConfig())
    executor = RayExecutor(Ray(num_actors=2), work, tiny_federation, model)
    try:
        start = {k: v.clone() for k, v in model.state_dict().items()}
        tasks = [TrainTask(i, start, seed=i, epochs=1) for i in range(3)]
        results_ = executor.train(tasks)
        assert isinstance(results_[1], ClientFailure) and results_[1].reason.startswith("its Ray actor died twice")
        expected = sequential(context).train([tasks[0], tasks[2]])
        for result, alone in zip([results_[0], results_[2]], expected):
            assert result.loss == alone.loss and all(torch.equal(result.params[k], v) for k, v in alone.params.items())
        with pytest.raises(ConfigError, match="^bad option; fix it$"):
            executor.train([TrainTask(3, start, seed=3, epochs=1)])
    finally:
        executor.close()
    assert executor.actors == [] and ray.is_initialized()  # its actors are gone; the Ray it did not start stays


@pytest.mark.slow
def test_an_unreachable_address_is_a_clear_error_before_anything_is_written(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    out = plfl("fit", "--config", str(tiny_config(tmp_path, 3)), f"ray.address={address}", env=environment())
    assert out.returncode == 2
    assert out.stderr.startswith(f"plfl fit: Could not reach the Ray cluster at ray.address={address} (")
    assert "Start a cluster with `ray start --head`" in out.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "run.yaml"]


def test_without_ray_installed_the_error_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    install = "runs on Ray, which is not installed. Install it with pip install -e '.[ray]'"
    with pytest.raises(ConfigError) as error:
        load_config(None, ["federation.executor=ray"])
    assert str(error.value).startswith(f"federation.executor=ray {install}")
    assert main(["sweep", str(write_sweep(tmp_path)), "--parallel", "2"]) == 2
    assert capsys.readouterr().err.startswith(f"plfl sweep: plfl sweep --parallel {install}")
    assert not (tmp_path / "out").exists()


def test_ray_keys_need_the_ray_executor():
    with pytest.raises(
        ConfigError,
        match=r"^ray.num_actors=4 is read only by federation.executor=ray, not by "
        r"federation.executor=vectorized. Remove ray.num_actors or set "
        r"federation.executor=ray.$",
    ):
        load_config(None, ["federation.executor=vectorized", "ray.num_actors=4"])


@pytest.mark.slow
def test_a_parallel_sweep_gives_the_sequential_results_and_resumes(local_ray, tmp_path):
    grid = {"federation.lr": {"values": [0.01, 0.1]}}
    one, two = tmp_path / "one", tmp_path / "two"
    for folder in (one, two):
        folder.mkdir()
    run_sweep(write_sweep(one, grid), echo=lambda line: None)
    run_sweep(write_sweep(two, grid), parallel=2, echo=lambda line: None)

    def table(folder):
        return rows(
            folder / "out" / "sweeps" / "sweep" / "results.csv",
            drop=("run_dir", "seconds_per_round"),
        )

    assert table(two) == table(one)
    assert [r["federation.lr"] for r in table(two)] == ["0.01", "0.1"] and table(two)[0]["status"] == "completed"
    finished = sorted((two / "out").glob("*/*/summary.json"))
    assert len(finished) == 2
    assert len(run_sweep(write_sweep(two, grid), parallel=2).trials) == 2  # nothing reruns
    assert sorted((two / "out").glob("*/*/summary.json")) == finished


@pytest.mark.slow
def test_a_parallel_suite_gives_the_sequential_table(local_ray, tmp_path):
    from plfl.reproduce import load_suite, run_suite

    from test_reproduce import write_suite

    tables = []
    for folder, parallel in ((tmp_path / "one", 1), (tmp_path / "two", 2)):
        folder.mkdir()
        _, results = run_suite(load_suite(write_suite(folder)), cells="digits/*", parallel=parallel, echo=print)
        tables.append([(r.setting, r.method, r.values) for r in results])
    assert tables[1] == tables[0] and len(tables[0]) == 2 and all(len(values) == 2 for _, _, values in tables[0])


@pytest.mark.slow
def test_a_stopped_parallel_sweep_continues_its_running_trials_with_their_parameters(
    local_ray, tmp_path, monkeypatch, capsys
):
    path = write_sweep(tmp_path, {"federation.lr": {"values": [0.01, 0.03, 0.1]}})
    # Rounds of 10 local epochs: a trial lasts seconds, so two of the three run at the same time.
    overrides = ["federation.rounds=40", "federation.local_epochs=10"]
    ray_wait = ray.wait

    def wait_then_ctrl_c(*args, **kwargs):
        # The sweep waits for its trials in half-second pieces: Ctrl+C once two unfinished trials (no summary.json
        # yet) have checkpointed a trained round. Which two depends on how fast Ray starts its workers.
        saved = {
            p.parents[1] for p in (tmp_path / "out").glob("*/*/checkpoints/round-*.pt") if p.name != "round-00000.pt"
        }
        if len({run for run in saved if not (run / "summary.json").exists()}) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return ray_wait(*args, **kwargs)

    monkeypatch.setattr(ray, "wait", wait_then_ctrl_c)
    assert main(["sweep", str(path), "--parallel", "2", *overrides]) == 130
    monkeypatch.setattr(ray, "wait", ray_wait)
    stopped = json.loads((tmp_path / "out" / "sweeps" / "sweep" / "trials.json").read_text())["trials"]
    running = {t["trial"]: t for t in stopped if t["status"] == "running"}
    assert len(running) == 2 and all(t["status"] == "completed" for t in stopped if t["trial"] not in running)
    first_rounds = {n: (Path(t["run_dir"]) / "metrics.csv").read_text().splitlines()[:3] for n, t in running.items()}

    assert main(["sweep", str(path), "--parallel", "2", *overrides]) == 0
    out = capsys.readouterr().out
    trials = {
        t["trial"]: t for t in json.loads((tmp_path / "out" / "sweeps" / "sweep" / "trials.json").read_text())["trials"]
    }
    for n, before in running.items():
        after = trials[n]
        assert (after["parameters"], after["run_dir"], after["status"]) == (
            before["parameters"],
            before["run_dir"],
            "completed",
        )
        assert f"(continues {after['run_dir']} from its newest checkpoint)" in out
        metrics = (Path(after["run_dir"]) / "metrics.csv").read_text().splitlines()
        assert metrics[:3] == first_rounds[n] and len(metrics) == 1 + 40 + 1
    # A trial proposed while the continued ones ran takes a grid value of its own.
    assert sorted(t["parameters"]["federation.lr"] for t in trials.values()) == [0.01, 0.03, 0.1]
    assert len(list((tmp_path / "out").glob("*/*/summary.json"))) == 3


@pytest.mark.slow
def test_ctrl_c_stops_the_run_and_the_ray_it_started(tmp_path):
    ray_dir = tempfile.mkdtemp(prefix="plfl-ray-")
    args = [sys.executable, "-m", "plfl", "fit", "--config", str(tiny_config(tmp_path, 200)), "ray.num_actors=1"]
    # A shell's background job inherits an ignored SIGINT, and Python then never raises KeyboardInterrupt: undo it.
    process = subprocess.Popen(
        args,
        cwd=ROOT,
        env=environment(RAY_TMPDIR=ray_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob("*/*/checkpoints/*")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_processes(ray_dir)  # the Ray this run started lives in RAY_TMPDIR
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert re.search(r"Stopped by SIGINT after round \d+; continue with: plfl fit --resume ", err)
    (run_dir,) = (p for p in tmp_path.glob("*/*") if p.is_dir())
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    assert len(rows(run_dir / "metrics.csv")) >= 1
    time.sleep(2)  # Ray's processes exit after ray.shutdown returns
    assert ray_processes(ray_dir) == []


def ray_processes(ray_dir: str) -> list[str]:
    """Ids of the processes whose command line names ``ray_dir``."""

    def command_line(pid: str) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
        except OSError:  # the process has exited
            return ""

    return [pid for pid in os.listdir("/proc") if pid.isdigit() and ray_dir in command_line(pid)]
