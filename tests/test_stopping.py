"""Stopping a run with SIGINT (Ctrl+C) or SIGTERM, sent for real to a ``plfl`` process in the middle of a local
epoch: it stops mid-epoch, sooner than the epoch would end, with its message, status and exit code, keeps its
finished rounds, and ``--resume`` then gives the metrics of an uninterrupted run. Also on the Ray executor and
inside ``plfl sweep``."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from plfl.config import load_config, resume_config
from plfl.experiment import run_experiment
from plfl.stopping import Stopped, deferred, stop_on_signals

from test_resume import ROOT, results

pytestmark = pytest.mark.slow  # real signals and subprocess runs: the slow tier

# One local epoch takes seconds: a wide MLP, batch 5, on two digits clients of ~900 samples each, one a round.
CONFIG = """\
name: slow
output_dir: {output}
progress_bar: false
data: {{source: digits, num_clients: 2, beta: 5.0}}
model: {{name: mlp, hidden_sizes: [3072, 3072]}}
federation: {{rounds: 1, join_ratio: 0.5, lr: 0.01, batch_size: 5, executor: {executor}}}
"""
# PYTHONPATH: the plfl of this tree whatever the working directory (a sweep runs from its own).
ENV = {"WANDB_MODE": "disabled", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def config(tmp_path: Path, executor: str = "sequential") -> Path:
    path = tmp_path / f"slow-{executor}.yaml"
    path.write_text(CONFIG.format(output=tmp_path / executor, executor=executor))
    return path


def plfl(*args: str, cwd: Path = ROOT) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "plfl", *args], cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def wait_for(directory: Path, pattern: str, process: subprocess.Popen, timeout_s: float = 300) -> Path:
    """The first file matching ``pattern`` under ``directory`` once it exists (the process must still run)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = sorted(directory.glob(pattern)) if directory.exists() else []
        if found:
            return found[0]
        assert process.poll() is None, process.communicate()
        time.sleep(0.1)
    raise TimeoutError(directory / pattern)


def stop_mid_epoch(process: subprocess.Popen, run_parent: Path, signum: int) -> tuple[str, str]:
    """Waits until round 0 is written (round 1's local training starts at once), lets it train a second, sends
    ``signum``; returns the process's (stdout, stderr) once it has exited."""
    wait_for(run_parent, "*/metrics.csv", process)
    time.sleep(1.0)
    process.send_signal(signum)
    return process.communicate(timeout=60)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple:
    """The results of the slow run, not interrupted (sequential; Ray gives the same numbers)."""
    run_dir, _ = run_experiment(load_config(config(tmp_path_factory.mktemp("uninterrupted"))))
    return results(run_dir)


# Ctrl-C on the sequential executor; SIGTERM (what a cluster's scheduler sends) with Ray's actors to stop too.
@pytest.mark.parametrize("signum, executor", [(signal.SIGINT, "sequential"), (signal.SIGTERM, "ray")])
def test_a_signal_mid_epoch_stops_the_run_in_that_round_and_resume_finishes_it(
    tmp_path, uninterrupted, signum, executor
):
    expected = uninterrupted
    if executor == "ray":
        pytest.importorskip("ray")
    process = plfl("fit", "--config", str(config(tmp_path, executor)))
    _, err = stop_mid_epoch(process, tmp_path / executor / "slow", signum)
    (run_dir,) = (tmp_path / executor / "slow").iterdir()
    name = signal.Signals(signum).name
    assert process.returncode == 128 + signum, err  # 130, 143
    assert (
        err.strip().splitlines()[-1] == f"Stopped by {name} after round 0; continue with: plfl fit --resume {run_dir}"
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["signal"], summary["rounds"]) == ("interrupted", name, 0)
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["round-00000.pt"]

    # Resumed in this process, Ray's run on the sequential executor (same numbers, no second Ray to start):
    # plfl fit --resume and resuming on Ray have tests of their own (test_resume.py, test_ray.py).
    resumed, _ = run_experiment(resume_config(run_dir, ["federation.executor=sequential"]), run_dir)
    assert resumed == run_dir and results(run_dir) == expected


def test_a_sweep_stops_on_a_signal_and_its_next_invocation_continues_the_trial(tmp_path, uninterrupted):
    (tmp_path / "configs").mkdir()
    config(tmp_path).rename(tmp_path / "configs" / "slow.yaml")
    (tmp_path / "sweep.yaml").write_text(
        textwrap.dedent("""\
            method: grid
            metric: {name: best_accuracy, goal: maximize}
            parameters:
              federation.lr: {values: [0.01]}
            command: [plfl, fit, --config, configs/slow.yaml, "${args_no_hyphens}"]
            """)
    )
    process = plfl("sweep", "sweep.yaml", cwd=tmp_path)
    _, err = stop_mid_epoch(process, tmp_path / "sequential" / "slow", signal.SIGINT)
    assert process.returncode == 130, err
    (run_dir,) = (tmp_path / "sequential" / "slow").iterdir()
    assert err.strip().splitlines()[-1] == (
        "Stopped by SIGINT; finished trials are saved; run the same command again to continue, "
        "the stopped trials first."
    )
    again = subprocess.run(
        [sys.executable, "-m", "plfl", "sweep", "sweep.yaml"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    (trial,) = json.loads((tmp_path / "sequential" / "sweeps" / "sweep" / "trials.json").read_text())["trials"]
    assert (trial["status"], trial["run_dir"]) == ("completed", str(run_dir))  # from its checkpoint of round 0


def test_a_second_signal_ends_the_process_at_once():
    script = textwrap.dedent("""\
        import os, signal, time
        from plfl.stopping import Stopped, stop_on_signals
        with stop_on_signals():
            try:
                os.kill(os.getpid(), signal.SIGINT)
            except Stopped:
                print("stopping", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)  # while the first is being handled
                time.sleep(30)
        print("not reached")
        """)
    done = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=20)
    assert (done.returncode, done.stdout) == (143, "stopping\n")


def test_a_signal_in_a_deferred_block_takes_effect_at_its_end():
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_signals():
        with pytest.raises(Stopped) as stop:
            with deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                written = True  # the block goes on: a round's files and checkpoint are written whole
        assert written and stop.value.name == "SIGTERM" and stop.value.exit_status == 143
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers come back
