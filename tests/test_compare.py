"""plfl compare and plfl fit --seeds: mean ± std over seeds in a method × data set table."""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from plfl.cli import main
from plfl.compare import comparison_table, find_runs, read_run
from plfl.errors import PlflError


def fake_run(path, method, source, seed, best, status="completed"):
    path.mkdir(parents=True)
    OmegaConf.save({"method": {"name": method}, "data": {"source": source, "root": None},
                    "federation": {"seed": seed}}, path / "config.yaml")
    summary = {"status": status, "best_accuracy": best, "seconds_per_round": 2.0 + seed,
               "params_sent_per_round": 100.0}
    (path / "summary.json").write_text(json.dumps(summary))


def test_table_holds_mean_and_population_std_per_method_and_dataset(tmp_path):
    fake_run(tmp_path / "a0", "fedavg", "digits", 0, 0.5)
    fake_run(tmp_path / "a1", "fedavg", "digits", 1, 0.7)
    fake_run(tmp_path / "b" / "t0", "fedala", "mnist", 0, 0.9)
    table = comparison_table([read_run(d) for d in find_runs([tmp_path])]).splitlines()
    assert table[0] == "| method | digits | mnist | s/round | params sent/round |"
    assert "| fedavg | 60.00 ± 10.00 (n=2) | – | 2.5 | 100 |" in table  # mean 0.6, pstdev 0.1, seconds (2+3)/2
    assert "| fedala | – | 90.00 (n=1) | 2.0 | 100 |" in table


def test_not_a_run_and_failed_run_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlflError, match="is not a plfl run directory"):
        read_run(tmp_path / "empty")
    with pytest.raises(PlflError, match="No run directories"):
        find_runs([tmp_path / "empty"])
    fake_run(tmp_path / "failed", "fedavg", "digits", 0, 0.5, status="failed")
    with pytest.raises(PlflError, match="did not complete"):
        read_run(tmp_path / "failed")
    assert main(["compare", str(tmp_path / "failed")]) == 2


def test_fit_over_seeds_reports_mean_and_std(digits_config, tmp_path, capsys):
    config = tmp_path / "digits.yaml"
    OmegaConf.save(digits_config(**{"federation.rounds": 1}), config)
    assert main(["fit", "--config", str(config), "--seeds", "3,4"]) == 0
    out = capsys.readouterr().out
    run_dirs = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("Run directory")]
    records = [read_run(Path(d)) for d in run_dirs]
    assert [r.seed for r in records] == [3, 4]
    assert records[0].best_accuracy != records[1].best_accuracy  # the seeds really differ
    mean = 50 * (records[0].best_accuracy + records[1].best_accuracy)
    spread = 50 * abs(records[0].best_accuracy - records[1].best_accuracy)
    assert f"| fedavg | {mean:.2f} ± {spread:.2f} (n=2) |" in out


def test_bad_seed_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "x.yaml", "--seeds", "0,a"])
    assert exit_info.value.code == 2
    assert "is not a comma-separated list of integers" in capsys.readouterr().err
