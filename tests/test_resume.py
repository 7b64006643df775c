"""Checkpoints and plfl fit --resume: a resumed run's metrics equal an uninterrupted run's, bit for bit."""

import csv
import io
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plfl.checkpoint import (
    CorruptCheckpoint,
    list_checkpoints,
    load_latest_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from plfl.cli import main
from plfl.config import load_config, resume_config
from plfl.errors import ConfigError, PlflError
from plfl.experiment import run_experiment

from conftest import every_method

ROOT = Path(__file__).resolve().parents[1]

# Runs plfl fit and SIGKILLs itself when the given client starts training in the given round.
KILLED_IN_ROUND = """
import os, signal, sys
from plfl.cli import main
from plfl.methods.base import Method
round_, client = int(sys.argv[1]), int(sys.argv[2])
train = Method.local_train
def local_train(self, client_id, params, message, r):
    if (r, client_id) == (round_, client):
        os.kill(os.getpid(), signal.SIGKILL)
    return train(self, client_id, params, message, r)
Method.local_train = local_train
sys.exit(main(sys.argv[3:]))
"""

FEDALA_OPTIONS = "  s: 80\n  p: 2\n"


def plfl(*args: str, killed_in: tuple[int, int] | None = None) -> subprocess.CompletedProcess:
    command = ["-c", KILLED_IN_ROUND, *map(str, killed_in)] if killed_in else ["-m", "plfl"]
    return subprocess.run(
        [sys.executable, *command, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={"WANDB_MODE": "disabled", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )  # one thread: see conftest.py


def run_dir_of(out: subprocess.CompletedProcess) -> Path:
    return Path(out.stdout.strip().splitlines()[-1].removeprefix("Run directory: "))


def rows(path: Path) -> list[dict[str, str]]:
    """A CSV's rows without the wall-clock column: everything else must match exactly."""
    with open(path) as f:
        return [{k: v for k, v in row.items() if k != "seconds"} for row in csv.DictReader(f)]


def results(run_dir: Path) -> tuple:
    summary = json.loads((run_dir / "summary.json").read_text())
    return (
        rows(run_dir / "metrics.csv"),
        rows(run_dir / "clients.csv"),
        {k: summary[k] for k in ("status", "best_accuracy", "best_round", "final_accuracy", "rounds")},
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, corrupt_latest, executor, offload",
    [
        ("fedavg", True, "sequential", False),
        ("fedftha", False, "vectorized", False),
        ("fedala", False, "sequential", True),  # ALA's client state, written to disk between rounds
    ],
)
def test_run_killed_mid_round_resumes_to_identical_metrics(tmp_path, method, corrupt_latest, executor, offload):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"name: {method}\noutput_dir: {tmp_path}\nprogress_bar: false\n"
        "data: {source: digits, num_clients: 5, beta: 0.5}\nmodel: {name: mlp, hidden_sizes: [32]}\n"
        f"method:\n  name: {method}\n{FEDALA_OPTIONS if method == 'fedala' else ''}"
        f"federation: {{rounds: 4, lr: 0.05, batch_size: 20, executor: {executor}, state_offload: {offload}}}\n"
    )
    full, _ = run_experiment(load_config(config))  # in this process: one thread, as the processes below

    killed = plfl("fit", "--config", str(config), killed_in=(3, 2))  # clients 0 and 1 of round 3 trained
    assert killed.returncode == -9
    run_dir = next(p for p in (tmp_path / method).iterdir() if p != full)
    assert not (run_dir / "summary.json").exists()
    assert [r["round"] for r in rows(run_dir / "metrics.csv")] == ["0", "1", "2"]
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["round-00002.pt", "round-00001.pt"]
    assert (run_dir / "client-state").exists() == offload  # left behind by the kill; the resumed run replaces it
    if corrupt_latest:
        latest = run_dir / "checkpoints" / "round-00002.pt"
        latest.write_bytes(latest.read_bytes()[:-1000])

    resumed = plfl("fit", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr
    assert run_dir_of(resumed) == run_dir and not (run_dir / "client-state").exists()
    if corrupt_latest:
        assert (
            "round-00002.pt is truncated or corrupt (its SHA-256 digest does not match). Using the "
            "checkpoint before it." in resumed.stderr
        )
    assert results(run_dir) == results(full)


EXTRA_OPTIONS = {
    "fedala": {"method.p": 2},
    "selffl": {"method.warmup_rounds": 1, "method.l_max": 5},
    "fedbn": {"model.batch_norm": True},
    # Schedules over the run's rounds unless fixed: APPLE's end L, FedPHP's T.
    "apple": {"method.schedule_rounds": 3},
    "fedphp": {"method.inheritance_rounds": 3},
    # Its last round fine-tunes every client: a run continued past round 2 keeps round 2's fine-tuned evaluation.
    "fedbabu": {"method.fine_tuning_epochs": 0},
    "partialfed": {"method.strategy": "adaptive", "method.warmup_rounds": 1},  # the learned strategy resumes too
}


@pytest.mark.parametrize("method", every_method())
def test_every_method_continues_from_its_checkpoint_exactly(digits_config, method):
    """Server state, client store and RNGs all come back: a 3-round run resumed from its round-2 checkpoint (its
    round-3 checkpoint and summary removed, as a run killed in round 3 leaves them) ends as it ended."""
    assert_resumes_exactly(digits_config(**{"method.name": method, **EXTRA_OPTIONS.get(method, {})}))


@pytest.mark.parametrize(
    "attack, rule",
    [
        ("sign_flip", "median"),
        ("gaussian", "norm_bound"),
        ("label_flip", "krum"),
        ("scale", "multi_krum"),
        ("backdoor", "trimmed_mean"),
    ],
)
def test_a_run_with_poisoned_clients_and_a_robust_rule_continues_exactly(digits_config, attack, rule):
    """The malicious clients (drawn from the seed), the Gaussian attack's noise (from (seed, round, client)) and the
    rule carry no state of their own: a resumed run ends as the uninterrupted one."""
    assert_resumes_exactly(digits_config(**{"attack.kind": attack, "attack.fraction": 0.4, "aggregation.rule": rule}))


def test_a_run_with_adaptive_client_dp_continues_exactly(digits_config):
    """The clip norm C, adapted each round, and the rounds accounted come back from the checkpoint; the noise comes
    from (seed, round): a resumed run's models, ε, C and unclipped fractions are the uninterrupted run's."""
    options = {"privacy.level": "client", "privacy.adaptive": True, "privacy.noise_multiplier": 0.3}
    assert_resumes_exactly(digits_config(**options, **{"privacy.clip": 0.5, "privacy.accountant": "prv"}))


def assert_resumes_exactly(config) -> None:
    """A 3-round run of ``config`` resumed from its round-2 checkpoint (its round-3 checkpoint and summary removed,
    as a run killed in round 3 leaves them) ends as it ended."""
    config.keep_checkpoints = 2
    run_dir, _ = run_experiment(config)
    straight = results(run_dir)
    (run_dir / "checkpoints" / "round-00003.pt").unlink()
    (run_dir / "summary.json").unlink()
    resumed, summary = run_experiment(resume_config(run_dir), run_dir)
    assert resumed == run_dir and summary["rounds"] == 3
    assert results(resumed) == straight


@pytest.mark.parametrize("method", ["fedavg", "ditto", "pfedme", "selffl"])
def test_a_run_in_local_steps_continues_from_its_checkpoint_exactly(digits_config, method):
    """federation.local_steps: the resumed round-3 clients take the same batches as in the uninterrupted run."""
    assert_resumes_exactly(
        digits_config(**{"method.name": method, **EXTRA_OPTIONS.get(method, {}), "federation.local_steps": 3})
    )


def test_checkpoint_reads_back_and_damage_is_detected(tmp_path):
    state = {"round": 3, "weights": torch.randn(4, 5), "counts": {1: 2.5, 7: None}, "rng": (3, (1, 2), None)}
    path = save_checkpoint(tmp_path, 3, state, keep=2)
    loaded = read_checkpoint(path)
    assert torch.equal(loaded["weights"], state["weights"]) and loaded["counts"] == state["counts"]

    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF  # one flipped byte inside the tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="round-00003.pt is truncated or corrupt"):
        read_checkpoint(path)
    path.write_bytes(b"")
    with pytest.raises(CorruptCheckpoint, match="truncated or corrupt"):
        read_checkpoint(path)


class RunsCommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def torch_saved(state) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("dump", [pickle.dumps, torch_saved], ids=["bare pickle", "torch.save zip"])
def test_checkpoint_holding_pickled_code_is_refused_without_running_it(tmp_path, dump):
    import hashlib

    marker = tmp_path / "pwned"
    payload = dump({"round": 1, "x": RunsCommand(marker)})
    path = tmp_path / "round-00001.pt"
    path.write_bytes(hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)  # a valid digest
    with pytest.raises(CorruptCheckpoint, match="round-00001.pt cannot be loaded safely"):
        read_checkpoint(path)
    assert not marker.exists()


def test_only_the_newest_checkpoints_are_kept_and_a_damaged_one_is_skipped(tmp_path):
    for round_ in range(4):
        save_checkpoint(tmp_path, round_, {"round": round_}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-00003.pt", "round-00002.pt"]
    (tmp_path / "round-00003.pt").write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="round-00003.pt is truncated or corrupt"):
        path, state = load_latest_checkpoint(tmp_path)
    assert path.name == "round-00002.pt" and state == {"round": 2}


def test_resume_refuses_what_it_cannot_continue(tmp_path, digits_config, capsys):
    with pytest.raises(PlflError, match=rf"{tmp_path} is not a plfl run directory \(it has no config.yaml\)"):
        resume_config(tmp_path)
    assert main(["fit", "--resume", str(tmp_path)]) == 2
    assert "is not a plfl run directory" in capsys.readouterr().err

    unsaved, _ = run_experiment(digits_config(**{"federation.rounds": 1, "checkpoint_every": 0}))
    with pytest.raises(PlflError, match="has no checkpoint .* Start it again with plfl fit --config"):
        run_experiment(resume_config(unsaved), unsaved)

    finished, _ = run_experiment(digits_config(**{"federation.rounds": 1}))
    with pytest.raises(
        PlflError, match="already finished round 1 of federation.rounds=1; to train longer, pass federation.rounds=N"
    ):
        run_experiment(resume_config(finished), finished)
    with pytest.raises(ConfigError, match="--resume cannot change data: the checkpoint holds state for the saved data"):
        resume_config(finished, ["data.num_clients=6"])
    assert main(["fit", "--resume", str(finished), "--config", "configs/quickstart.yaml"]) == 2
    assert "drop --config and --seeds" in capsys.readouterr().err
