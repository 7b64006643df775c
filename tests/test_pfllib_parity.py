"""benchmarks/pfllib_parity.py against a stand-in for PFLlib's main.py that prints PFLlib's log format."""

from __future__ import annotations

import csv
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from plfl.errors import PlflError
from plfl.experiment import run_experiment

from conftest import load_script, run_main

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "pfllib_parity.py"
parity = load_script(SCRIPT)

# PFLlib's main.py as far as this script reads it: the echoed arguments, a block per run (--times),
# "Averaged Test Accuracy" per round, "All done!". It fails as PFLlib would when the data is not at
# ../dataset/NAME/{train,test}/{i}.npz, and keeps its argv so that tests can check the flags.
FAKE_MAIN = """
import json, sys, time
from pathlib import Path
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
here = Path(__file__).parent
with open(here / "argv.jsonl", "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
for split in ("train", "test"):
    for i in range(int(args["--num_clients"])):
        Path("../dataset", args["--dataset"], split, f"{i}.npz").open("rb").close()
accuracies = json.loads((here / "accuracies.json").read_text())
print("=" * 50)
for name, value in args.items():
    print(name[2:], "=", value)
print("=" * 50)
for run in range(int(args["--times"])):
    print(f"\\n============= Running time: {run}th =============")
    for r in range(int(args["--global_rounds"]) + 1):
        print(f"\\n-------------Round number: {r}-------------")
        print("Averaged Train Loss: 2.3000")
        if args["--algorithm"] == "Ditto":  # its global model first, then the personal models
            print("Averaged Test Accuracy: 0.0100")
        print(f"Averaged Test Accuracy: {accuracies[run][r]:.4f}")
        print("Std Test Accuracy: 0.0100", flush=True)
time.sleep(60)  # PFLlib trains once more after its last evaluation
print("All done!")
"""


def federation(root: Path, clients: int = 3) -> Path:
    """A PFLlib-format federation with FedALA's file names (train/train{i}_.npz), 28×28 images, 2 classes."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 24), ("test", 8)):
        (root / split).mkdir(parents=True)
        for i in range(clients):
            x = rng.uniform(-1, 1, (n, 1, 28, 28)).astype(np.float32)
            y = np.arange(n, dtype=np.int64) % 2
            np.savez_compressed(root / split / f"{split}{i}_.npz", data={"x": x, "y": y})
    (root / "config.json").write_text(json.dumps({"num_clients": clients, "num_classes": 2}))
    return root


@pytest.fixture
def fake_pfllib(tmp_path: Path) -> Path:
    system = tmp_path / "PFLlib" / "system"
    system.mkdir(parents=True)
    (system / "main.py").write_text(FAKE_MAIN)
    (system / "accuracies.json").write_text(json.dumps([[0.10, 0.50, 0.60], [0.12, 0.54, 0.70], [0.11, 0.52, 0.65]]))
    return tmp_path / "PFLlib"


def run_script(capsys, fake: Path, data: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """The script in this process; both sides still run as processes of their own."""
    return run_main(parity, capsys, "--pfllib", str(fake), "--data", str(data), "--out", str(out), *extra)


@pytest.mark.slow
def test_compares_with_pfllib_over_seeds_and_reuses_finished_sides(tmp_path, fake_pfllib, capsys):
    data = federation(tmp_path / "data")
    out = tmp_path / "out"
    args = ("--method", "ditto", "--rounds", "2", "--seeds", "2", "--from-round", "1")
    first = run_script(capsys, fake_pfllib, data, out, *args, "--tolerance", "100")
    assert first.returncode == 0, first.stdout + first.stderr

    # PFLlib got plfl's settings, Ditto's λ as its --mu, and ran both seeds in one process (--times).
    (argv,) = [json.loads(line) for line in (fake_pfllib / "system" / "argv.jsonl").read_text().splitlines()]
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--algorithm"] == "Ditto"
    assert (flags["--mu"], flags["--plocal_epochs"], flags["--times"], flags["--num_clients"]) == ("1.0", "1", "2", "3")
    assert (flags["--global_rounds"], flags["--batch_size"], flags["--local_learning_rate"]) == ("2", "10", "0.005")

    # The table: plfl's accuracy from its runs' metrics.csv, PFLlib's from the log, mean ± sample std.
    plfl = []
    for seed in (0, 1):
        (metrics,) = (out / "plfl" / f"seed{seed}").glob("*/metrics.csv")
        plfl.append({int(row["round"]): 100 * float(row["accuracy"]) for row in csv.DictReader(metrics.open())})
    for r, pfllib in zip(range(3), ([10, 12], [50, 54], [60, 70])):
        mean = (plfl[0][r] + plfl[1][r]) / 2
        std = abs(plfl[0][r] - plfl[1][r]) / 2**0.5
        row = f"| {r} | {mean:.2f} ± {std:.2f} | {np.mean(pfllib):.2f} ± {np.std(pfllib, ddof=1):.2f} | "
        assert row + f"{mean - np.mean(pfllib):+.2f} |" in first.stdout
    largest = max(abs((plfl[0][r] + plfl[1][r]) / 2 - p) for r, p in ((1, 52), (2, 65)))
    assert f"largest |gap| from round 1: {largest:.2f} pp" in first.stdout
    rows = list(csv.DictReader((out / "parity.csv").open()))
    assert [row["round"] for row in rows] == ["0", "1", "2"] and float(rows[2]["pfllib"]) == pytest.approx(65)

    # PFLlib was stopped once its last round was in, before the training it does after it.
    assert "Round number: 2" in (out / "pfllib.log").read_text() and "All done!" not in (out / "pfllib.log").read_text()

    # Run again with a tolerance the gap exceeds: nothing is rerun, the exit status is 1.
    runs_before = sorted(out.glob("plfl/seed*/*"))
    second = run_script(capsys, fake_pfllib, data, out, *args, "--tolerance", str(largest / 2))
    assert second.returncode == 1, second.stdout + second.stderr
    assert "running:" not in second.stdout
    assert len((fake_pfllib / "system" / "argv.jsonl").read_text().splitlines()) == 1
    assert sorted(out.glob("plfl/seed*/*")) == runs_before

    # A third seed: each side runs only the new one; PFLlib's, in a new process, is that process's first run.
    third = run_script(
        capsys, fake_pfllib, data, out, *args[:-4], "--seeds", "3", "--from-round", "1", "--tolerance", "100"
    )
    assert third.returncode == 0, third.stdout + third.stderr
    assert sorted(out.glob("plfl/seed[01]/*")) == runs_before and len(list(out.glob("plfl/seed2/*"))) == 1
    argv = json.loads((fake_pfllib / "system" / "argv.jsonl").read_text().splitlines()[1])
    assert dict(zip(argv[::2], argv[1::2]))["--times"] == "1"
    assert "Running time: 0th" in (out / "pfllib-2.log").read_text()
    assert float(list(csv.DictReader((out / "parity.csv").open()))[2]["pfllib"]) == pytest.approx((60 + 70 + 60) / 3)


@pytest.mark.slow
def test_a_changed_setting_reruns_the_pfllib_side(tmp_path, fake_pfllib):
    out = tmp_path / "out"
    log = out / "pfllib.log"
    side = parity.PfllibSide(
        fake_pfllib,
        federation(tmp_path / "data", 2),
        "MNIST",
        {"times": "1", "mu": "1.0", "global_rounds": "0"},
        out,
        parity.METHODS["fedavg"],
    )
    assert side.accuracies() is None
    log.write_text(
        "mu = 1.0\ntimes = 1\nglobal_rounds = 0\n\nRunning time: 0th\nRound number: 0\n"
        "Averaged Test Accuracy: 0.5\nAll done!\n"
    )
    assert side.accuracies() == [{0: 50.0}]
    side.offset = 1  # FedPHP: PFLlib evaluates after local training, so its round r is plfl's r + 1
    assert side.accuracies() == [{1: 50.0}]
    log.write_text(log.read_text().replace("mu = 1.0", "mu = 0.0"))
    assert side.accuracies() is None
    assert (
        out / "pfllib" / "dataset" / "MNIST" / "test" / "1.npz"
    ).resolve() == tmp_path / "data" / "test" / "test1_.npz"
    # A new process's log never overwrites a kept one, even with an earlier one deleted.
    (out / "pfllib-3.log").write_text("")
    args = {"times": "1", "mu": "1.0", "global_rounds": "0"}
    again = parity.PfllibSide(fake_pfllib, tmp_path / "data", "MNIST", args, out, parity.METHODS["fedavg"])
    assert again.log == out / "pfllib-4.log"


@pytest.mark.slow
def test_a_round_is_in_once_pfllib_printed_all_its_evaluations(tmp_path, fake_pfllib):
    out = tmp_path / "out"
    args = {"times": "1", "global_rounds": "1"}
    side = parity.PfllibSide(fake_pfllib, federation(tmp_path / "data", 1), "MNIST", args, out, parity.METHODS["ditto"])
    log = "times = 1\nglobal_rounds = 1\nRunning time: 0th\n"
    for r, (global_model, personal) in enumerate([(0.1, 0.1), (0.5, 0.9)]):
        log += f"Round number: {r}\nAveraged Test Accuracy: {global_model}\nAveraged Test Accuracy: {personal}\n"
    (out / "pfllib.log").write_text(log.rsplit("Averaged", 1)[0])  # round 1's personal models not yet evaluated
    assert side.accuracies() is None
    (out / "pfllib.log").write_text(log)
    assert side.accuracies() == [{0: 10.0, 1: 90.0}]


def test_an_evaluation_after_the_last_round_is_awaited_and_left_out(tmp_path, fake_pfllib):
    # FedBABU's PFLlib run prints its fine-tuned models' accuracy after the last round's global model's.
    out = tmp_path / "out"
    args = {"times": "1", "global_rounds": "1"}
    pairing = parity.METHODS["fedbabu"]
    side = parity.PfllibSide(fake_pfllib, federation(tmp_path / "data", 1), "MNIST", args, out, pairing)
    log = "times = 1\nglobal_rounds = 1\nRunning time: 0th\n"
    log += "Round number: 0\nAveraged Test Accuracy: 0.1\nRound number: 1\nAveraged Test Accuracy: 0.5\n"
    (out / "pfllib.log").write_text(log)
    assert side.accuracies() is None  # the fine-tuned models are still to be evaluated
    (out / "pfllib.log").write_text(log + "Averaged Test Accuracy: 0.97\n")
    assert side.accuracies() == [{0: 10.0, 1: 50.0}]


def test_a_finished_plfl_run_is_reused_under_keys_added_after_it(tmp_path, digits_config):
    """A run whose config.yaml predates a key (here federation.drop_last) is the run of that key's default."""
    out = tmp_path / "out"
    run_dir = out / "plfl" / "seed0" / "earlier"
    run_dir.mkdir(parents=True)
    cfg = digits_config(**{"federation.rounds": 1})
    run_experiment(cfg, run_dir=run_dir)
    saved = OmegaConf.load(run_dir / "config.yaml")
    del saved.federation["drop_last"]
    OmegaConf.save(saved, run_dir / "config.yaml")
    side = parity.PlflSide(SCRIPT, [], cfg, 1, out, "accuracy")
    assert side._run_dir(0) == run_dir
    later = OmegaConf.merge(cfg, {"federation": {"drop_last": True}})
    assert parity.PlflSide(SCRIPT, [], later, 1, out, "accuracy")._run_dir(0) is None


def test_reads_pfllib_log_per_run():
    text = (
        "algorithm = FedAvg\ntimes = 2\n==\n\n============= Running time: 0th =============\n"
        "-------------Round number: 0-------------\nAveraged Test Accuracy: 0.0588\n"
        "-------------Round number: 1-------------\nAveraged Test Accuracy: 0.8000\n"
        "Evaluate personalized models\nAveraged Test Accuracy: 0.9100\n"
        "============= Running time: 1th =============\n"
        "-------------Round number: 0-------------\nAveraged Test Accuracy: 0.1000\n"
    )
    echoed, runs = parity.read_pfllib_log(text)
    assert echoed == {"algorithm": "FedAvg", "times": "2"}
    assert runs == [{0: [pytest.approx(5.88)], 1: [80.0, 91.0]}, {0: [10.0]}]
    assert parity.read_pfllib_log("Running time: 0th\nRound number: 3\nAverage Test Accuracy: 0.25")[1] == [{3: [25.0]}]
    with pytest.raises(PlflError, match="not PFLlib's main.py log"):
        parity.read_pfllib_log("Averaged Test Accuracy: 0.5\n")


def test_gap_is_plfl_minus_pfllib_of_the_seed_means():
    rows, largest = parity.compare([{0: 10, 3: 80}, {0: 12, 3: 82}], [{0: 11, 3: 79}], from_round=3)
    assert rows[1] == [3, 81, pytest.approx(2**0.5), 79, 0.0, 2]
    assert largest == 2  # round 0's gap is not checked
    with pytest.raises(PlflError, match="none in common from 5"):
        parity.compare([{0: 10}], [{0: 11}], from_round=5)


def test_pfllib_flags_come_from_plfls_config():
    cfg = parity.load_config(ROOT / "configs" / "apple.yaml", ["federation.rounds=10", "method.schedule_rounds=5"])
    args = parity.pfllib_args(cfg, parity.METHODS["apple"], "MNIST", 20, 3)
    assert (args["L"], args["dr_learning_rate"], args["mu"], args["global_rounds"]) == ("0.5", "0.001", "0.1", "10")
    cfg = parity.load_config(ROOT / "configs" / "perfedavg.yaml", ["federation.local_epochs=3"])
    with pytest.raises(PlflError, match="local_epochs=3 is odd"):
        parity.pfllib_args(cfg, parity.METHODS["perfedavg"], "MNIST", 20, 1)


def test_missing_pfllib_checkout_is_named(tmp_path, capsys):
    result = run_script(
        capsys, tmp_path / "nowhere", federation(tmp_path / "data"), tmp_path / "out", "--method", "fedavg"
    )
    assert result.returncode == 1
    assert re.search(r"nowhere/system/main.py does not exist: pass --pfllib", result.stderr)


def test_docs_show_the_flag_table():
    page = (ROOT / "docs" / "explanation" / "fidelity.md").read_text()
    assert parity.mapping_table() in page
