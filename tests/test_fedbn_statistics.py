"""benchmarks/fedbn_statistics.py rebuilds FedBN's evaluated models from a checkpoint."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real signals and subprocess runs: the slow tier

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "fedbn_statistics.py"
CONFIG = """
data: {source: digits, num_clients: 4, partition: dirichlet, beta: 0.1}
model: {name: mlp, hidden_sizes: [32], batch_norm: true}
method: {name: %s}
federation: {rounds: 2, batch_size: 10, lr: 0.05}
progress_bar: false
keep_checkpoints: 2
"""


def fit(tmp_path: Path, method: str) -> Path:
    (tmp_path / f"{method}.yaml").write_text(CONFIG % method)
    command = [str(Path(sys.executable).with_name("plfl")), "fit", "--config", str(tmp_path / f"{method}.yaml")]
    subprocess.run([*command, f"output_dir={tmp_path}"], check=True, capture_output=True, cwd=ROOT, timeout=300)
    (run_dir,) = (tmp_path / f"{method}-digits").iterdir()
    return run_dir


@pytest.fixture(scope="module")
def fedbn_run(tmp_path_factory) -> Path:
    return fit(tmp_path_factory.mktemp("fedbn"), "fedbn")


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_evaluated_models_reproduce_the_runs_accuracy(fedbn_run):
    for round_ in ("1", "2"):
        result = probe(str(fedbn_run), "--round", round_)
        assert result.returncode == 0, result.stderr
        reported = re.search(r"the run's accuracy ([0-9.]+) %", result.stdout).group(1)
        assert f"evaluated: {reported} %" in result.stdout
        assert re.search(r"re-estimated: [0-9.]+ %\nshared γ, β: [0-9.]+ %", result.stdout)


def test_a_missing_round_names_the_rounds_kept(fedbn_run):
    result = probe(str(fedbn_run), "--round", "7")
    assert result.returncode == 1
    assert re.search(r"round-00007.pt does not exist \(kept: round-00001.pt, round-00002.pt\)", result.stderr)


def test_another_method_is_refused(tmp_path):
    result = probe(str(fit(tmp_path, "fedavg")))
    assert result.returncode == 1 and "is a fedavg run; this reads FedBN runs" in result.stderr
