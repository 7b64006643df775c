"""plfl compare and plfl fit --seeds: mean ± std over seeds in a method × data set table."""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from plfl.cli import main
from plfl.compare import comparison_table, find_runs, read_run
from plfl.errors import PlflError


def fake_run(path, method, source, seed, best, status="completed", seconds=2.0, params=100.0):
    path.mkdir(parents=True)
    OmegaConf.save(
        {"method": {"name": method}, "data": {"source": source, "root": None}, "federation": {"seed": seed}},
        path / "config.yaml",
    )
    summary = {"status": status, "best_accuracy": best, "seconds_per_round": seconds, "params_sent_per_round": params}
    (path / "summary.json").write_text(json.dumps(summary))


def test_table_holds_mean_and_population_std_per_method_and_dataset(tmp_path):
    fake_run(tmp_path / "a0", "fedavg", "digits", 0, 0.5)
    fake_run(tmp_path / "a1", "fedavg", "digits", 1, 0.7)
    fake_run(tmp_path / "b" / "t0", "fedala", "mnist", 0, 0.9)
    accuracy, costs = comparison_table([read_run(d) for d in find_runs([tmp_path])]).split("\n\n")
    assert accuracy.splitlines() == [
        "| method | digits | mnist |",
        "| --- | --- | --- |",
        "| fedavg | 60.00 ± 10.00 (n=2) | – |",  # mean 0.6, pstdev 0.1
        "| fedala | – | 90.00 (n=1) |",
    ]
    assert costs.splitlines()[:2] == [
        "| method | data set | s/round | params sent/round | n |",
        "| --- | --- | --- | --- | --- |",
    ]


def test_costs_are_per_data_set_never_averaged_across_them(tmp_path):
    # The reported case: FedALA at 103 s per round on MNIST and 0.31 s on digits, two seeds each.
    fake_run(tmp_path / "m0", "fedala", "mnist", 0, 0.96, seconds=102.0, params=11_640_520)
    fake_run(tmp_path / "m1", "fedala", "mnist", 1, 0.95, seconds=104.5, params=11_640_520)
    fake_run(tmp_path / "d0", "fedala", "digits", 0, 0.40, seconds=0.30, params=6050)
    fake_run(tmp_path / "d1", "fedala", "digits", 1, 0.42, seconds=0.32, params=6050)
    fake_run(tmp_path / "f0", "fedavg", "digits", 0, 0.30, seconds=0.25, params=6050)
    costs = comparison_table([read_run(d) for d in find_runs([tmp_path])]).split("\n\n")[1].splitlines()
    assert costs[2:] == [
        "| fedala | digits | 0.31 | 6,050 | 2 |",  # (0.30 + 0.32) / 2
        "| fedala | mnist | 103.25 | 11,640,520 | 2 |",  # (102 + 104.5) / 2
        "| fedavg | digits | 0.25 | 6,050 | 1 |",
    ]


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


def test_one_source_split_two_ways_is_two_data_sets(tmp_path):
    def run(path, partition, **data):
        fake_run(path, "fedavg", "mnist", 0, 0.5)
        cfg = OmegaConf.load(path / "config.yaml")
        cfg.data.update(partition=partition, **data)
        OmegaConf.save(cfg, path / "config.yaml")

    run(tmp_path / "a", "dirichlet", beta=0.1)
    run(tmp_path / "b", "dirichlet", beta=0.5, num_clients=100)
    run(tmp_path / "c", "classes", classes_per_client=4, num_clients=10)
    fake_run(tmp_path / "d", "fedavg", "pfllib", 0, 0.5)  # a PFLlib directory keeps its own clients
    cfg = OmegaConf.load(tmp_path / "d" / "config.yaml")
    cfg.data.update(root="/data/fedala-mnist-dir0.1", partition="dirichlet")
    OmegaConf.save(cfg, tmp_path / "d" / "config.yaml")
    accuracy = comparison_table([read_run(d) for d in find_runs([tmp_path])]).split("\n\n")[0]
    assert accuracy.splitlines()[0] == (
        "| method | mnist Dir(0.1), 20 clients | mnist Dir(0.5), 100 clients | "
        "mnist classes(4 classes), 10 clients | pfllib:fedala-mnist-dir0.1 |"
    )
