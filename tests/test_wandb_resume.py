"""plfl fit --resume with W&B: every round reaches W&B once, read back from the offline .wandb files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from plfl.config import resume_config
from plfl.errors import PlflWarning
from plfl.experiment import run_experiment

from test_resume import KILLED_IN_ROUND, ROOT


def offline_runs(run_dir: Path) -> list[tuple[dict, list[dict]]]:
    """(run record, history rows) of each offline .wandb file under ``run_dir``, oldest first, as
    W&B's own reader (``wandb leet inspect --json``) decodes them."""
    runs = []
    for path in (run_dir / "wandb").glob("offline-run-*"):
        out = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
            capture_output=True,
            text=True,
            check=True,
        )
        records = [json.loads(line) for line in out.stdout.splitlines()]
        run = next(r["run"] for r in records if r["type"] == "run")
        runs.append((run, [r["history"]["item"] for r in records if r["type"] == "history"]))
    return sorted(runs, key=lambda r: r[0]["start_time"])


def synced_history(run_dir: Path) -> dict[str, list[dict]]:
    """The history each W&B run has once ``wandb sync`` uploaded the offline files in start order: a file
    resuming its own run from a branch point (a rewind) first drops the steps after that point."""
    history: dict[str, list[dict]] = {}
    for run, rows in offline_runs(run_dir):
        kept = history.setdefault(run["run_id"], [])
        point = run.get("branch_point")
        if point and point["run"] == run["run_id"]:
            assert point["metric"] == "_step"
            kept[:] = [row for row in kept if row["_step"] <= point.get("value", 0)]  # JSON omits a 0
        kept.extend(rows)
    return history


@pytest.mark.slow
def test_resumed_run_rewinds_its_wandb_run_so_every_round_is_logged_once(tmp_path, monkeypatch):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"name: wb\noutput_dir: {tmp_path}\nprogress_bar: false\ncheckpoint_every: 2\n"
        "logger: {name: wandb, project: plfl-test}\n"
        "data: {source: digits, num_clients: 5, beta: 0.5}\nmodel: {name: mlp, hidden_sizes: [32]}\n"
        "method: {name: fedavg}\nfederation: {rounds: 5, lr: 0.05, batch_size: 20}\n"
    )
    # W&B writes its .wandb file every 15 s: flush often, so that round 0 is on disk before the kill.
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL": "0.1",
        "HOME": str(tmp_path),
        "PATH": "/usr/bin:/bin",
    }
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_IN_ROUND, "4", "0", "fit", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert killed.returncode == -9, killed.stderr
    run_dir = next((tmp_path / "wb").iterdir())
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    # W&B got round 0 and maybe more, up to round 3; the newest checkpoint is of round 2.
    [(_, logged)] = offline_runs(run_dir)
    assert [row["round"] for row in logged] == list(range(len(logged))) and 1 <= len(logged) <= 4
    assert (run_dir / "checkpoints" / "round-00002.pt").is_file()
    assert not (run_dir / "checkpoints" / "round-00003.pt").exists()

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_experiment(resume_config(run_dir), run_dir)

    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    _, (resumed, relogged) = offline_runs(run_dir)
    assert resumed["run_id"] == run_id
    assert resumed["branch_point"]["run"] == run_id and resumed["branch_point"].get("value", 0) == 0
    assert [row["round"] for row in relogged] == [1, 2, 3, 4, 5]  # 1-2 from the checkpoint, 3-5 trained
    [rows] = synced_history(run_dir).values()
    assert [row["round"] for row in rows] == [0, 1, 2, 3, 4, 5]
    assert all(row["_step"] == row["round"] for row in rows)


@pytest.mark.slow
def test_rounds_that_wandb_lacks_are_logged_again_from_the_checkpoint(digits_config, monkeypatch):
    """A killed run's W&B files may lack its last rounds, the checkpoint's included (W&B writes every
    few seconds): here W&B has rounds 0-1 and the checkpoint is of round 3."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir, _ = run_experiment(digits_config(**{"logger.name": "wandb", "federation.rounds": 1}))
    run_experiment(resume_config(run_dir, ["logger.name=csv", "federation.rounds=3"]), run_dir)
    run_experiment(resume_config(run_dir, ["logger.name=wandb", "federation.rounds=4"]), run_dir)
    [rows] = synced_history(run_dir).values()
    assert [row["round"] for row in rows] == [0, 1, 2, 3, 4]


def refuse_rewind(monkeypatch):
    import wandb

    init = wandb.init

    def init_without_rewind(*args, **kwargs):
        if kwargs.get("resume_from"):
            raise wandb.errors.CommError("failed to rewind run: rewinding is not enabled on this server")
        return init(*args, **kwargs)

    monkeypatch.setattr(wandb, "init", init_without_rewind)


@pytest.fixture
def agent_run_id(monkeypatch):
    """WANDB_RUN_ID = sweeprun1, as a sweep agent sets it for its subprocess."""
    import wandb

    monkeypatch.setenv("WANDB_RUN_ID", "sweeprun1")
    wandb.teardown()  # W&B reads the environment once per process
    yield
    monkeypatch.delenv("WANDB_RUN_ID")
    wandb.teardown()


@pytest.mark.slow
@pytest.mark.parametrize("cause", ["rewind refused", "sweep agent"])
def test_without_a_rewind_a_new_wandb_run_names_the_old_one(digits_config, monkeypatch, request, cause):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir, _ = run_experiment(digits_config(**{"logger.name": "wandb", "federation.rounds": 2}))
    old_id = (run_dir / "wandb_run_id").read_text().strip()
    if cause == "rewind refused":
        refuse_rewind(monkeypatch)
    else:
        request.getfixturevalue("agent_run_id")

    with pytest.warns(
        PlflWarning,
        match=rf"W&B run {old_id} is not continued: .*\. A new W&B run logs rounds 0-2 "
        rf"from the checkpoint .* resumed_from: \{{run_id: {old_id}, round: 2\}}",
    ):
        run_experiment(resume_config(run_dir, ["federation.rounds=4"]), run_dir)

    new_id = (run_dir / "wandb_run_id").read_text().strip()
    assert new_id != old_id and (cause == "rewind refused" or new_id == "sweeprun1")
    _, (new, _) = offline_runs(run_dir)
    assert new["run_id"] == new_id and "branch_point" not in new
    assert new["config"]["update"]["resumed_from"] == {"run_id": old_id, "round": 2}
    history = synced_history(run_dir)
    assert [row["round"] for row in history[old_id]] == [0, 1, 2]
    assert [row["round"] for row in history[new_id]] == [0, 1, 2, 3, 4]
    assert all(row["_step"] == row["round"] for rows in history.values() for row in rows)
