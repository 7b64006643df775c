"""plfl compare and plfl fit --seeds: mean ± std over seeds in a method × data set table."""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from plfl.cli import main
from plfl.compare import comparison_table, find_runs, read_run, value_texts
from plfl.errors import PlflError


def fake_run(
    path, method, source, seed, best, status="completed", seconds=2.0, params=100.0, final=None, more=None, **sections
):
    """A run directory's config.yaml and summary.json (20 rounds); ``final``: (accuracy, worst 10 %, largest 10 %)
    at the final round, None for a summary from before they were kept; ``more``: other summary keys; ``keys`` in
    ``sections``: more config by section."""
    path.mkdir(parents=True)
    config = {"method": {"name": method}, "data": {"source": source, "root": None}, "federation": {"seed": seed}}
    for section, values in sections.get("keys", {}).items():
        config[section] = {**config.get(section, {}), **values}
    OmegaConf.save(config, path / "config.yaml")
    summary = {"status": status, "best_accuracy": best, "seconds_per_round": seconds, "params_sent_per_round": params}
    summary.update(rounds=20, **(more or {}))
    if final is not None:
        keys = ("final_accuracy", "final_worst10_accuracy", "final_largest10_accuracy")
        summary.update(zip(keys, final))
    if status != "completed":
        summary["error" if status == "failed" else "signal"] = "RuntimeError: boom" if status == "failed" else "SIGINT"
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
        "| method | data set | rounds | s/round | params sent/round | n |",
        "| --- | --- | --- | --- | --- | --- |",
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
        "| fedala | digits | 20 | 0.31 | 6,050 | 2 |",  # (0.30 + 0.32) / 2
        "| fedala | mnist | 20 | 103.25 | 11,640,520 | 2 |",  # (102 + 104.5) / 2
        "| fedavg | digits | 20 | 0.25 | 6,050 | 1 |",
    ]


def test_the_clients_table_holds_self_fls_table_1_columns_for_runs_that_recorded_them(tmp_path):
    fake_run(tmp_path / "s0", "selffl", "digits", 0, 0.8, final=(0.7, 0.2, 0.9))
    fake_run(tmp_path / "s1", "selffl", "digits", 1, 0.8, final=(0.8, 0.4, 0.7))
    fake_run(tmp_path / "f0", "fedavg", "digits", 0, 0.6)  # a summary without them: no row
    clients = comparison_table([read_run(d) for d in find_runs([tmp_path])]).split("\n\n")[2].splitlines()
    assert clients == [
        "| method | data set | final accuracy | worst 10 % of clients | largest 10 % of clients | n |",
        "| --- | --- | --- | --- | --- | --- |",
        "| selffl | digits | 75.00 ± 5.00 | 30.00 ± 10.00 | 80.00 ± 10.00 | 2 |",
    ]
    fake_run(tmp_path / "only-old", "fedavg", "mnist", 0, 0.6)
    assert comparison_table([read_run(tmp_path / "only-old")]).count("\n\n") == 1  # no clients table


def test_unseen_clients_and_simulated_time_get_their_columns_where_runs_have_them(tmp_path):
    unseen = {"best_unseen_accuracy": 0.5, "best_participation_gap": 0.3, "simulated_seconds_per_round": 12.5}
    fake_run(tmp_path / "a0", "fedavg", "digits", 0, 0.8, more=unseen)
    fake_run(
        tmp_path / "a1",
        "fedavg",
        "digits",
        1,
        0.6,
        more={**unseen, "best_unseen_accuracy": 0.7, "best_participation_gap": -0.1},
    )
    fake_run(tmp_path / "b0", "ditto", "digits", 0, 0.9)
    tables = comparison_table([read_run(d) for d in find_runs([tmp_path])]).split("\n\n")
    assert (
        tables[1].splitlines()[0]
        == "| method | data set | rounds | s/round | simulated s/round | params sent/round | n |"
    )
    assert tables[1].splitlines()[2:] == [
        "| fedavg | digits | 20 | 2.00 | 12.50 | 100 | 2 |",
        "| ditto | digits | 20 | 2.00 | – | 100 | 1 |",
    ]
    assert tables[2].splitlines() == [
        "| method | data set | participating clients | unseen clients | participation gap | n |",
        "| --- | --- | --- | --- | --- | --- |",
        "| fedavg | digits | 70.00 ± 10.00 | 60.00 ± 10.00 | 10.00 ± 20.00 | 2 |",
    ]


def test_not_a_run_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlflError, match="is not a plfl run directory"):
        read_run(tmp_path / "empty")
    with pytest.raises(PlflError, match="No run directories"):
        find_runs([tmp_path / "empty"])


def test_runs_that_did_not_complete_are_listed_apart_and_never_block_the_rest(tmp_path, capsys):
    fake_run(tmp_path / "ok", "fedavg", "digits", 0, 0.5)
    fake_run(tmp_path / "failed", "fedavg", "digits", 1, 0.9, status="failed")
    fake_run(tmp_path / "stopped", "fedavg", "digits", 2, 0.1, status="interrupted")
    assert main(["compare", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| fedavg | 50.00 (n=1) |" in out  # the completed run alone
    assert out.rstrip().splitlines()[-3:] == [
        "Not completed, left out:",
        f"- {tmp_path / 'failed'}: failed (RuntimeError: boom)",
        f"- {tmp_path / 'stopped'}: interrupted (SIGINT)",
    ]


def test_runs_with_other_hyperparameters_are_rows_of_their_own_named_by_them(tmp_path):
    # FedALA at s=80, p=2 over two seeds (one on another executor), and two sweep trials at p=1: three rows.
    fake_run(tmp_path / "a0", "fedala", "mnist", 0, 0.90, keys={"method": {"s": 80, "p": 2}})
    fake_run(
        tmp_path / "a1",
        "fedala",
        "mnist",
        1,
        0.92,
        keys={"method": {"s": 80, "p": 2}, "federation": {"executor": "ray"}},
    )
    fake_run(
        tmp_path / "t1", "fedala", "mnist", 0, 0.40, keys={"method": {"s": 5, "p": 1}, "logger": {"name": "wandb"}}
    )
    fake_run(tmp_path / "t2", "fedala", "mnist", 0, 0.60, keys={"method": {"s": 10, "p": 1}})
    # A key that differs only between data sets (each config's own lr) splits nothing.
    fake_run(tmp_path / "d0", "fedavg", "mnist", 0, 0.70, keys={"federation": {"lr": 0.005}})
    fake_run(tmp_path / "d1", "fedavg", "agnews", 0, 0.80, keys={"federation": {"lr": 0.1}})
    accuracy = comparison_table([read_run(d) for d in find_runs([tmp_path])]).split("\n\n")[0].splitlines()
    assert accuracy[2:] == [
        "| fedala (s=80, p=2) | 91.00 ± 1.00 (n=2) | – |",
        "| fedala (s=5, p=1) | 40.00 (n=1) | – |",
        "| fedala (s=10, p=1) | 60.00 (n=1) | – |",
        "| fedavg | 70.00 (n=1) | 80.00 (n=1) |",
    ]


def test_compare_takes_a_sweep_directory_and_finds_its_trials(tmp_path, monkeypatch, capsys):
    # plfl sweep ran in another directory: trials.json records run_dir relative to it, under output_dir=out.
    for trial, s in enumerate((5, 10), start=1):
        fake_run(
            tmp_path / "out" / "fedala-s" / f"t{trial}",
            "fedala",
            "mnist",
            0,
            0.5 + trial / 10,
            keys={"method": {"s": s}},
        )
    trials = [{"trial": t, "run_dir": f"out/fedala-s/t{t}", "status": "completed"} for t in (1, 2)]
    trials.append({"trial": 3, "run_dir": None, "status": "failed"})  # failed before its run directory existed
    (tmp_path / "out" / "sweeps" / "fedala_s").mkdir(parents=True)
    (tmp_path / "out" / "sweeps" / "fedala_s" / "trials.json").write_text(json.dumps({"trials": trials}))
    monkeypatch.chdir(tmp_path / "out")  # elsewhere than where the sweep ran
    assert find_runs([Path("sweeps/fedala_s")]) == [Path("fedala-s/t1"), Path("fedala-s/t2")]
    assert main(["compare", "sweeps/fedala_s"]) == 0
    assert "| fedala (s=10) | 70.00 (n=1) |" in capsys.readouterr().out


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


def test_hub_data_and_flower_partitions_are_named_by_their_id_and_partitioner():
    from plfl.compare import dataset_name

    data = {"source": "hf", "path": "uoft-cs/cifar100", "num_clients": 20, "partition": "flwr"}
    flower = {"partitioner": "DirichletPartitioner", "partitioner_args": {"alpha": 0.5, "partition_by": "label"}}
    name = dataset_name(OmegaConf.create({"data": {**data, **flower}}))
    assert name == "hf:uoft-cs/cifar100 DirichletPartitioner(alpha=0.5, partition_by=label), 20 clients"


def test_sampled_values_are_rounded_to_the_digits_that_keep_them_apart(tmp_path):
    assert value_texts([0.0031622776601683794, 0.01, 20, "adam"]) == ["0.00316", "0.01", "20", "adam"]
    assert value_texts([0.123456, 0.123457]) == ["0.123456", "0.123457"]
    for i, lr in enumerate((0.0031622776601683794, 0.0031622776601683795 + 1e-9)):
        fake_run(tmp_path / f"r{i}", "fedavg", "digits", 0, 0.5, keys={"federation": {"lr": lr}})
    accuracy = comparison_table([read_run(d) for d in find_runs([tmp_path])]).split("\n\n")[0].splitlines()
    assert [line.split(" | ")[0] for line in accuracy[2:]] == ["| fedavg (lr=0.003162278)", "| fedavg (lr=0.003162279)"]
