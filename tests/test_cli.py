"""`plfl fit` from the command line: run directory, output, and failures without tracebacks."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from plfl.cli import main

ROOT = Path(__file__).resolve().parents[1]


def plfl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env_cmd = [sys.executable, "-m", "plfl", *args]
    return subprocess.run(
        env_cmd,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={"WANDB_MODE": "disabled", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )  # one thread: see conftest.py


@pytest.mark.slow
def test_quickstart_runs_and_writes_the_run_directory(tmp_path):
    out = plfl("fit", "--config", "configs/quickstart.yaml", f"output_dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("Run directory: ")
    run_dir = Path(last.removeprefix("Run directory: "))
    assert run_dir.parent == tmp_path / "quickstart"
    assert {p.name for p in run_dir.iterdir()} >= {"config.yaml", "metrics.csv", "clients.csv", "summary.json"}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 20
    for key in (
        "best_accuracy",
        "final_accuracy",
        "best_round",
        "seconds_per_round",
        "params_sent_per_round",
        "params_received_per_round",
    ):
        assert summary[key] is not None, key
    assert summary["best_accuracy"] > 0.8  # digits, Dir(0.1), 20 clients: measured 0.9x
    assert len((run_dir / "metrics.csv").read_text().splitlines()) == 1 + 21
    # The run directory when the run starts (stderr), a line per round with the run's ETA, and the disk use.
    assert out.stderr.splitlines()[0] == f"Run directory: {run_dir} (torch threads: 1)"
    assert re.search(r"^round +20/20  accuracy .* s  ETA 0:00:00$", out.stderr, re.MULTILINE)
    assert re.fullmatch(
        r"Disk use: [\d.,]+ MB, checkpoints [\d.,]+ MB of it \(keep_checkpoints=N keeps the newest N; null, the "
        r"default, keeps the last one once a run completes; checkpoint_every=0 writes none\)",
        out.stdout.splitlines()[-2],
    )
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["round-00020.pt"]  # completed: the last one


def test_a_torchvision_that_is_not_torchs_build_is_one_clear_error_before_training(tmp_path, monkeypatch, capsys):
    from plfl import cli

    monkeypatch.setitem(sys.modules, "torchvision", None)  # an import that fails, as a mismatched build does
    assert cli.main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    torch, vision = cli.installed("torch"), cli.installed("torchvision")
    assert err.startswith(f"plfl fit: torchvision {vision} does not load beside torch {torch} (")
    pair = f"torchvision==0.{int(torch.split('.')[1]) + 15}.*"
    assert f"Install {pair} from the index torch came from" in err and not any(tmp_path.iterdir())

    monkeypatch.undo()
    versions = {"torch": "2.14.1", "torchvision": "0.28.0+cpu"}
    monkeypatch.setattr(cli, "installed", lambda package: versions.get(package, "1.0"))
    assert cli.main(["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), f"output_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.startswith(
        "plfl fit: torchvision 0.28.0+cpu is not the build for torch 2.14.1. Install torchvision==0.29.* from"
    )


def test_keep_checkpoints_keeps_that_many_of_a_completed_run(digits_config):
    from plfl.experiment import run_experiment

    run_dir, _ = run_experiment(digits_config(**{"federation.rounds": 3, "keep_checkpoints": 3}))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"round-0000{r}.pt" for r in (1, 2, 3)]


@pytest.mark.slow
def test_print_config_shows_the_resolved_config():
    out = plfl("fit", "--config", "configs/fedala.yaml", "--print-config", "federation.rounds=7")
    assert out.returncode == 0, out.stderr
    assert "  rounds: 7" in out.stdout
    assert str((ROOT.parent / "shared" / "data" / "fedala-mnist-dir0.1").resolve()) in out.stdout  # absolute


@pytest.mark.slow
def test_overrides_may_stand_on_both_sides_of_an_option():
    out = plfl("fit", "--config", "configs/fedala.yaml", "federation.rounds=7", "--print-config", "federation.lr=0.25")
    assert out.returncode == 0, out.stderr
    assert "  rounds: 7" in out.stdout and "  lr: 0.25" in out.stdout


@pytest.mark.slow
def test_bad_input_exits_nonzero_with_one_paragraph_and_no_traceback(tmp_path):
    out = plfl("fit", "--config", "configs/quickstart.yaml", "federation.join_ratio=0", f"output_dir={tmp_path}")
    assert out.returncode == 2
    assert out.stderr.strip() == ("plfl fit: Config key 'federation.join_ratio' must be a number in (0, 1]; got 0.0.")
    assert not any(tmp_path.iterdir())  # nothing written
    debug = plfl("--debug", "fit", "--config", "configs/quickstart.yaml", "federation.join_ratio=0")
    assert "Traceback" in debug.stderr


def test_missing_data_directory_is_a_clear_error(tmp_path, capsys):
    status = main(
        ["fit", "--config", "configs/fedala.yaml", f"data.root={tmp_path / 'nowhere'}", f"output_dir={tmp_path}"]
    )
    err = capsys.readouterr().err
    assert status == 2
    assert "PFLlib data directory" in err and "does not exist" in err
    assert "Traceback" not in err


def test_version_is_the_package_version():
    from plfl import __version__

    out = plfl("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"plfl {__version__} (Python ")
    assert "torch " in out.stdout and "lightning " in out.stdout


def test_fit_without_config_names_the_example_configs(tmp_path):
    out = plfl("fit", f"output_dir={tmp_path}")
    assert out.returncode == 2
    assert out.stderr.startswith("plfl fit: plfl fit needs --config FILE (or --resume RUN_DIR).")
    assert "quickstart.yaml" in out.stderr and "fedala.yaml" in out.stderr
    assert not any(tmp_path.iterdir())  # no hidden default run


def test_methods_lists_every_registered_method_with_keys_and_defaults(capsys):
    from plfl.methods import methods

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    listed = [line.split(":")[0] for line in out.splitlines() if line and not line.startswith(" ")]
    assert listed == list(methods())
    assert "  method.s = 80.0 (a percentage in (0, 100]): percentage of the client's training data" in out
    assert "  method.k = 1 (an integer >= 0)" in out
    main(["methods", "selffl"])
    one = capsys.readouterr().out
    assert one.startswith("selffl: Self-FL (Chen et al., NeurIPS 2022)")
    assert "method.ala" not in one  # Self-FL has its own local initialisation
    assert main(["methods", "fedala", "fedrox"]) == 2
    bad = capsys.readouterr()
    assert bad.out == "" and "Unknown method.name 'fedrox'" in bad.err


@pytest.mark.slow
def test_a_config_error_imports_no_torch_and_a_valid_config_only_its_methods_module():
    # Config errors answer before torch (seconds) is imported: every section but the method's is checked from plain
    # declarations, the method's against its config class rebuilt from its module's source. --print-config then
    # checks the method section against the method's module too (torch), and still
    # imports no Lightning, W&B, plotly, torchvision or scikit-learn (seconds more).
    heavy = "('torch', 'lightning', 'wandb', 'plotly', 'torchvision', 'sklearn')"
    code = (
        "import sys; from plfl.cli import main; "
        f"loaded = lambda: sorted(m for m in {heavy} if m in sys.modules); "
        "errors = [main(['fit', '--config', 'configs/fedala.yaml', o]) for o in ('roundz=3', 'data.cache_dir=/x', "
        "'model.hidden_dim=8', 'federation.executor=spark', 'method.name=fedrox', 'method.sx=40', 'method.s=0')]; "
        "before = loaded(); "
        "status = main(['fit', '--config', 'configs/fedala.yaml', '--print-config']); "
        "print('heavy:', before, loaded(), 'status:', errors, status)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "heavy: [] ['torch'] status: [2, 2, 2, 2, 2, 2, 2] 0", out.stderr
    assert "Did you mean 'federation.rounds'?" in out.stderr
    assert "Unknown config key 'method.sx'. Did you mean 'method.s'?" in out.stderr
