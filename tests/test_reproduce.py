"""plfl reproduce: suite files, their runs (resumed, never repeated), and the table beside the paper's values."""

import csv
import statistics
from pathlib import Path

import pytest
import yaml

from plfl.cli import main
from plfl.errors import ConfigError
from plfl.report import write_report
from plfl.reproduce import cell_config, list_suites, load_suite, run_suite

SUITE = {
    "title": "A hand-made table",
    "paper": "Nobody, Workshop 2026",
    "rounds": 2,
    "seeds": 2,
    "metric": "accuracy",
    "round": "best",
    "settings": {"digits": {"config": None}, "digits-beta5": {"config": None, "overrides": ["data.beta=5.0"]}},
    "methods": {
        "fedavg": ["method=fedavg"],
        "local": {"overrides": ["method=local"], "metric": "test_loss"},
    },
    "reported": {"fedavg": {"digits": "50.5 ± 1.25", "digits-beta5": 40}, "local": {"digits": None}},
    "claims": ["fedavg > local"],
}


def write_suite(tmp_path: Path, **changes) -> Path:
    """A suite over a tiny digits config (2 clients, MLP) with output in tmp_path/out; ``changes`` replace keys
    (None removes one)."""
    config = {
        "output_dir": str(tmp_path / "out"),
        "progress_bar": False,
        "keep_checkpoints": 2,
        "data": {"source": "digits", "num_clients": 2, "beta": 0.5},
        "model": {"name": "mlp", "hidden_sizes": [16]},
        "federation": {"lr": 0.05, "batch_size": 50, "threads": 1},
    }
    (tmp_path / "digits.yaml").write_text(yaml.safe_dump(config))
    suite = yaml.safe_load(yaml.safe_dump(SUITE))
    for setting in suite["settings"].values():
        setting["config"] = str(tmp_path / "digits.yaml")
    for key, value in changes.items():
        if value is None:
            suite.pop(key)
        else:
            suite[key] = value
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, allow_unicode=True))
    return path


def metric_values(run_dir: Path, column: str) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(r[column]) for r in csv.DictReader(f) if r[column]]


def test_a_suite_parses_into_cells_reported_values_and_claims(tmp_path):
    suite = load_suite(write_suite(tmp_path))
    assert suite.name == "suite" and suite.rounds == 2 and suite.seeds == 2 and suite.round_rule == "best"
    # Method by method, each over every setting: the table's order.
    assert suite.cells == [
        ("digits", "fedavg"),
        ("digits-beta5", "fedavg"),
        ("digits", "local"),
        ("digits-beta5", "local"),
    ]
    assert suite.reported == {("digits", "fedavg"): (50.5, 1.25), ("digits-beta5", "fedavg"): (40.0, None)}
    assert suite.claims == [("fedavg", "local")]
    assert suite.metric_of("fedavg") == "accuracy" and suite.metric_of("local") == "test_loss"
    config, overrides = cell_config(suite, "digits-beta5", "local", 7, 3, ["federation.lr=0.1"])
    assert config == str(tmp_path / "digits.yaml")
    assert overrides == [
        "data.beta=5.0",
        "method=local",
        "federation.rounds=7",
        "federation.seed=3",
        "federation.lr=0.1",
    ]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"metric": None}, "missing metric"),
        ({"rows": {}}, "unknown rows"),
        ({"round": "last"}, "round must be one of best, final; got 'last'"),
        ({"seeds": 0}, "seeds must be an integer >= 1; got 0"),
        (
            {"settings": {"digits": {"overrides": ["data.beta=5.0"]}}},
            "settings.digits must be a mapping with config",
        ),
        ({"methods": {"fedavg": ["fedavg"]}}, "methods.fedavg.overrides must be a list of key=value overrides"),
        (
            {"reported": {"fedprox": {"digits": 1}}},
            "reported names method 'fedprox'; the suite's methods are fedavg, local",
        ),
        ({"reported": {"fedavg": {"mnist": 1}}}, "reported.fedavg names setting 'mnist'"),
        ({"reported": {"fedavg": {"digits": "about 50"}}}, "reported.fedavg.digits = 'about 50' must be a number"),
        ({"claims": ["fedavg beats local"]}, "claim 'fedavg beats local' must be 'A > B'"),
        ({"cells": ["digits:fedavg"]}, "cell 'digits:fedavg' must be SETTING/METHOD"),
    ],
)
def test_a_malformed_suite_is_refused_with_the_key_and_the_fix(tmp_path, changes, message):
    with pytest.raises(ConfigError, match="suite.yaml") as error:
        load_suite(write_suite(tmp_path, **changes))
    assert message in str(error.value)


def test_a_missing_suite_names_the_repositorys_suites(capsys):
    assert main(["reproduce", "no-such-suite"]) == 2
    err = capsys.readouterr().err
    assert "no-such-suite.yaml does not exist" in err and "fedftha" in err and "plfl reproduce --list" in err


def test_an_invalid_cell_config_stops_the_suite_before_any_run(tmp_path):
    path = write_suite(tmp_path, methods={"fedavg": ["method=fedavg", "method.s=80"]}, reported={}, claims=[])
    with pytest.raises(ConfigError, match="method.s"):
        run_suite(load_suite(path), echo=lambda line: None)
    assert not (tmp_path / "out").exists()


def test_the_table_gives_plfl_beside_the_paper_and_the_gap_and_a_second_call_runs_nothing(tmp_path, capsys):
    path = write_suite(tmp_path)
    assert main(["reproduce", str(path), "--cells", "digits/*"]) == 0
    out = capsys.readouterr().out
    suite_dir = tmp_path / "out" / "reproduce" / "suite"
    runs = {m: [suite_dir / "digits" / m / "rounds-2" / f"seed-{s}" for s in (0, 1)] for m in ("fedavg", "local")}
    # best: the highest accuracy over the evaluated rounds (0, 1, 2) of each seed; local's metric is its test loss.
    fedavg = [max(metric_values(d, "accuracy")) for d in runs["fedavg"]]
    local = [max(metric_values(d, "test_loss")) for d in runs["local"]]
    mean, std = 100 * statistics.fmean(fedavg), 100 * statistics.pstdev(fedavg)
    row = (
        f"| digits | fedavg | accuracy (best) | {mean:.2f} ± {std:.2f} | 50.50 ± 1.25 | {mean - 50.5:+.2f} | 2/2 | 2 |"
    )
    assert row in out
    assert f"| digits | local | test_loss (best) | {100 * statistics.fmean(local):.2f} ± " in out
    assert "digits-beta5" not in out  # not selected and never run
    holds = "holds" if mean > 100 * statistics.fmean(local) else "does not hold"
    assert f"- digits: {holds} ({mean:.2f} vs {100 * statistics.fmean(local):.2f})" in out
    with open(suite_dir / "results.csv") as f:
        table = {(r["setting"], r["method"]): r for r in csv.DictReader(f)}
    assert float(table[("digits", "fedavg")]["gap"]) == pytest.approx(mean - 50.5)
    assert table[("digits", "fedavg")]["scaled"] == "False"
    assert (suite_dir / "results.md").read_text() in out

    # The report of the suite directory shows the same table above its runs.
    page = write_report([suite_dir], tmp_path / "report.html").read_text()
    assert "<h2>A hand-made table</h2>" in page and f'<td class="num">{mean - 50.5:+.2f}</td>' in page
    assert f"<li>fedavg &gt; local: digits: {holds} ({mean:.2f} vs" in page

    stamps = {d: (d / "summary.json").stat().st_mtime_ns for ds in runs.values() for d in ds}
    lines = []
    run_suite(load_suite(path), cells="digits/*", echo=lines.append)
    assert lines == [] and stamps == {d: (d / "summary.json").stat().st_mtime_ns for d in stamps}


def test_a_half_finished_suite_continues_its_stopped_run_and_gives_the_same_table(tmp_path):
    path = write_suite(tmp_path, methods={"fedavg": ["method=fedavg"]}, claims=[], reported={})
    suite = load_suite(path)
    _, first = run_suite(suite, cells="digits/*", echo=lambda line: None)
    # Seed 1 as if killed during round 2: its round-1 checkpoint is the newest left, no summary.json.
    run_dir = tmp_path / "out" / "reproduce" / "suite" / "digits" / "fedavg" / "rounds-2" / "seed-1"
    (run_dir / "summary.json").unlink()
    (run_dir / "checkpoints" / "round-00002.pt").unlink()
    # A run written before a config key existed (here data.augment) is the same experiment at the key's default.
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    del config["data"]["augment"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    _, table = run_suite(suite, cells="digits/*", echo=print, run=False)  # the table so far, nothing run
    assert table[0].values == first[0].values[:1] and table[0].failed == [f"{run_dir}: unfinished (round 2 of 2)"]
    assert not (run_dir / "summary.json").exists()
    lines = []
    _, again = run_suite(suite, cells="digits/*", echo=lines.append)
    assert lines == [f"digits/fedavg seed 1: {run_dir} (continues)", "digits/fedavg seed 1: completed"]
    assert again[0].values == first[0].values  # bit for bit, as an uninterrupted run


def test_fewer_rounds_are_marked_scaled_and_kept_apart_from_full_runs(tmp_path, capsys):
    path = write_suite(tmp_path, methods={"fedavg": ["method=fedavg"]}, claims=[], reported={}, rounds=3)
    assert main(["reproduce", str(path), "--cells", "digits-beta5/fedavg", "--rounds", "1", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "| digits-beta5 | fedavg | accuracy (best) |" in out and "| 1/1 | 1 (scaled) |" in out
    assert (tmp_path / "out" / "reproduce" / "suite" / "digits-beta5" / "fedavg" / "rounds-1" / "seed-0").is_dir()


def test_a_changed_suite_refuses_the_runs_of_the_old_one(tmp_path):
    path = write_suite(tmp_path, methods={"fedavg": ["method=fedavg"]}, claims=[], reported={})
    run_suite(load_suite(path), cells="digits/fedavg", seeds=1, echo=lambda line: None)
    with pytest.raises(ConfigError) as error:
        run_suite(load_suite(path), ["federation.lr=0.2"], cells="digits/fedavg", seeds=1, echo=lambda line: None)
    assert "holds a run of another config: federation.lr (0.05 there, 0.2 now)" in str(error.value)
    assert "output_dir=" in str(error.value)


def test_no_matching_cell_lists_the_cells(tmp_path):
    with pytest.raises(ConfigError, match="its cells are digits/fedavg, digits-beta5/fedavg, digits/local"):
        run_suite(load_suite(write_suite(tmp_path)), cells="mnist/*", echo=lambda line: None)


def test_list_shows_every_suite_of_the_repository(capsys):
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    for suite in list_suites():
        assert f"{suite.name}: {suite.title} ({len(suite.cells)} cells, {suite.rounds} rounds" in out


def test_methods_with_the_same_overrides_read_one_run_and_a_failed_run_says_why(tmp_path, capsys):
    methods = {"fedavg": ["method=fedavg"], "fedavg-loss": {"overrides": ["method=fedavg"], "metric": "test_loss"}}
    settings = {"digits": {"config": str(tmp_path / "digits.yaml")}}
    settings["crowded"] = {"config": str(tmp_path / "digits.yaml"), "overrides": ["data.num_clients=1000"]}
    path = write_suite(tmp_path, methods=methods, settings=settings, claims=[], reported={})
    assert main(["reproduce", str(path), "--seeds", "1"]) == 1  # a run failed
    out = capsys.readouterr().out
    # One run per setting: fedavg-loss reads fedavg's, from the directory named after the first of the two.
    assert out.count("seed 0: completed") == 1 and out.count("seed 0: failed") == 1
    run_dir = tmp_path / "out" / "reproduce" / "suite" / "digits" / "fedavg" / "rounds-2" / "seed-0"
    assert not (tmp_path / "out" / "reproduce" / "suite" / "digits" / "fedavg-loss").exists()
    loss = max(metric_values(run_dir, "test_loss"))
    assert f"| digits | fedavg-loss | test_loss (best) | {100 * loss:.2f} |  |  | 1/1 | 2 |" in out
    # The crowded federation cannot give 1000 clients 10 digits each: its error, not "not run", is in the table.
    assert "Runs without a value (an unfinished run continues" in out
    assert "Cannot give each of 1000 clients at least 10 samples" in out
