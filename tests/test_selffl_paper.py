"""benchmarks/selffl_paper.py: the per-round table over seeds, and a finished run reused rather than run again."""

import json
from pathlib import Path

import pytest

from conftest import load_script

paper = load_script(Path(__file__).resolve().parents[1] / "benchmarks" / "selffl_paper.py")


def test_round_table_averages_each_metric_over_the_seeds_at_the_rounds_all_evaluated():
    seed0 = {0: {"accuracy": 0.1}, 10: {"accuracy": 0.5, "global_accuracy": 0.4}, 20: {"accuracy": 0.7}}
    seed1 = {0: {"accuracy": 0.1}, 10: {"accuracy": 0.7, "global_accuracy": 0.6}}  # stopped before round 20
    rows = paper.round_table("mnist", {"selffl": [seed0, seed1]})
    assert [r["round"] for r in rows] == [0, 10]
    # Round 10: mean 60 %, population std 10 %; the global model's too; round 0 has no global accuracy.
    assert rows[1] == {
        "setting": "mnist",
        "method": "selffl",
        "round": 10,
        "seeds": 2,
        "accuracy": 60.0,
        "accuracy_std": 10.0,
        "global_accuracy": 50.0,
        "global_accuracy_std": 10.0,
    }
    assert "global_accuracy" not in rows[0] and rows[0]["accuracy_std"] == 0.0


def test_a_completed_run_is_reused_and_an_unfinished_one_is_not(tmp_path):
    for time, status in (("20260101-000000", "completed"), ("20260102-000000", "interrupted")):
        (tmp_path / "fedavg-seed0" / time).mkdir(parents=True)
        (tmp_path / "fedavg-seed0" / time / "summary.json").write_text(json.dumps({"status": status}))
    assert paper.run_dir(tmp_path, "fedavg-seed0") == tmp_path / "fedavg-seed0" / "20260101-000000"
    assert paper.run_dir(tmp_path, "ditto-seed0") is None
    assert paper.fit(Path("unused.yaml"), tmp_path, "fedavg-seed0", []) == tmp_path / "fedavg-seed0" / "20260101-000000"


def test_an_unknown_setting_names_the_ones_there_are(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["selffl_paper.py", "--setting", "svhn"])
    settings = "cifar10, femnist, femnist-cnn, femnist-fedprox, mnist"
    with pytest.raises(SystemExit, match=f"selffl-svhn.yaml does not exist; settings: {settings}"):
        paper.main()
