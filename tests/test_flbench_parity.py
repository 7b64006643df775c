"""benchmarks/flbench_parity.py: FL-bench's data folder written from plfl's clients, the settings FL-bench gets from
plfl's config, and FL-bench's log read back (no FL-bench run)."""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.datasets import MNIST

from plfl.data.loading import load_federated_data
from plfl.errors import PlflError

from conftest import load_script, run_main

ROOT = Path(__file__).resolve().parents[1]
parity = load_script(ROOT / "benchmarks" / "flbench_parity.py")


def pfllib_mnist(root: Path, clients: int = 3) -> Path:
    """A PFLlib-format federation of 28×28 images (p/255 − 0.5)/0.5 of random 8-bit pixels p, 10 classes, clients
    of different sizes."""
    rng = np.random.default_rng(0)
    for split, base in (("train", 12), ("test", 5)):
        (root / split).mkdir(parents=True)
        for i in range(clients):
            pixels = rng.integers(0, 256, (base + 3 * i, 1, 28, 28), dtype=np.uint8)
            x = (torch.from_numpy(pixels).float() / 255 - 0.5) / 0.5
            y = rng.integers(0, 10, len(x)).astype(np.int64)
            np.savez_compressed(root / split / f"{split}{i}_.npz", data={"x": x.numpy(), "y": y})
    (root / "config.json").write_text(json.dumps({"num_clients": clients, "num_classes": 10}))
    return root


def federation(tmp_path: Path):
    cfg = parity.load_config(
        ROOT / "configs" / "cfl.yaml", [f"data.root={pfllib_mnist(tmp_path / 'data')}", "data.source=pfllib"]
    )
    return load_federated_data(cfg.data, 0)


def test_the_flbench_folder_holds_exactly_plfls_clients(tmp_path):
    data = federation(tmp_path)
    target = tmp_path / "flbench" / "data" / "mnist"
    parity.write_flbench_mnist(data, target)

    # FL-bench's mnist: torchvision's reader of the raw files, train then t10k, pixels / 255, then normalised by
    # the launcher's (0.5, 0.5).
    parts = [MNIST(str(target), train, download=False) for train in (True, False)]
    images = (torch.cat([p.data for p in parts]).float().unsqueeze(1) / 255 - 0.5) / 0.5
    labels = torch.cat([p.targets for p in parts])
    partition = pickle.loads((target / "partition.pkl").read_bytes())
    assert partition["separation"] == {"train": [0, 1, 2], "val": [0, 1, 2], "test": [0, 1, 2], "total": 3}
    for client, indices in zip(data.clients, partition["data_indices"]):
        assert torch.equal(images[indices["train"]], client.x_train)
        assert torch.equal(labels[indices["train"]], client.y_train)
        assert torch.equal(images[indices["test"]], client.x_test)
        assert torch.equal(labels[indices["test"]], client.y_test)
        assert indices["val"] == []
    every = [i for indices in partition["data_indices"] for split in indices.values() for i in split]
    assert sorted(every) == list(range(len(labels)))  # each sample belongs to one client's one split
    assert json.loads((target / "args.json").read_text())["split"] == "sample"


def test_images_that_are_not_8_bit_pixels_are_refused(tmp_path):
    data = federation(tmp_path)
    data.clients[1].x_test[0, 0, 0, 0] += 1e-3
    with pytest.raises(PlflError, match="not \\(p/255 - 0.5\\)/0.5 of 8-bit pixels"):
        parity.write_flbench_mnist(data, tmp_path / "out")


def test_flbench_settings_come_from_plfls_config():
    pairing = parity.METHODS["cfl"]
    cfg = parity.load_config(
        ROOT / "configs" / "cfl.yaml",
        ["federation.rounds=7", "federation.lr=0.02", "method.min_cluster_size=4", *parity._required(pairing)],
    )
    args = parity.flbench_args(cfg, pairing)
    assert (args["method"], args["model.name"], args["optimizer.name"]) == ("cfl", "avgcnn", "sgd")
    assert (args["common.global_epoch"], args["optimizer.lr"], args["common.batch_size"]) == ("7", "0.02", "10")
    assert args["++cfl.min_cluster_size"] == "3"  # plfl splits clusters of at least 4, FL-bench of more than 3
    assert (args["++cfl.eps_1"], args["++cfl.start_clustering_round"]) == ("0.4", "20")
    assert args["common.test.client.interval"] == "1" and args["common.test.client.finetune_epoch"] == "0"
    assert cfg.method.linkage == "complete"


def test_a_plfl_setting_flbench_cannot_follow_is_refused(tmp_path, capsys):
    data = pfllib_mnist(tmp_path / "data")
    common = ("--flbench", str(tmp_path), "--python", "python", "--data", str(data), "--out", str(tmp_path / "out"))
    result = run_main(parity, capsys, *common, "--method", "cfl", "method.linkage=single")
    assert result.returncode == 1
    assert "method.linkage=single: FL-bench bipartitions by complete linkage" in result.stderr
    result = run_main(parity, capsys, *common, "--method", "fedas", "method.align_batch_size=16")
    assert "method.align_batch_size=16: FL-bench aligns on its training batches" in result.stderr
    result = run_main(parity, capsys, *common, "--method", "fedavg")
    assert "main.py does not exist: pass --flbench" in result.stderr


# The end of FL-bench's main.log as rich writes it: lines padded to 80 columns, long ones wrapped.
MAIN_LOG = "\n".join(
    line.ljust(80)
    for line in """==================== CFL Experiment Results: ====================
Display format: (before local fine-tuning) -> (after local fine-tuning)
 So if finetune_epoch = 0, x.xx% -> 0.00% is normal.
 Centralized testing ONLY happens after model aggregation, so the stats between
'->' are the same.
{
    "1": {
        "all_clients": {
            "test": {
                "loss": "2.2342 -> 0.0000",
                "accuracy": "19.85% -> 0.00%"
            }
        }
    },
    "2": {
        "all_clients": {
            "test": {
                "loss": "0.4000 -> 0.0000",
                "accuracy": "90.50% -> 0.00%"
            }
        }
    }
}
==================== CFL Max Accuracy ====================
all_clients:
(test) before fine-tuning: 90.50% at epoch 2""".splitlines()
)


def test_reads_flbenchs_client_side_test_results():
    assert parity.read_test_results(MAIN_LOG) == {1: 19.85, 2: 90.5}
    assert parity.read_test_results(MAIN_LOG.split('"2"')[0]) == {}  # not finished printing
    assert parity.read_test_results("==== CFL ====\n") == {}


def test_docs_show_the_settings_table():
    page = (ROOT / "docs" / "explanation" / "fidelity.md").read_text()
    assert parity.mapping_table() in page


# FL-bench's main.py as far as the script relies on it: it imports src.utils.constants (which the launcher has set
# to PFLlib's normalisation), reads data/mnist beside its own file, and writes Hydra's overrides, main.log (its
# test results, per round) and metrics.csv under ./out/<method>/<dataset>/<time>/ of the working folder.
FAKE_MAIN = """
import json, pickle, sys
from pathlib import Path
from src.utils import constants
assert constants.DATA_MEAN["mnist"] == [0.5] and constants.DATA_STD["mnist"] == [0.5]
here = Path(__file__).parent
partition = pickle.loads((here / "data" / "mnist" / "partition.pkl").read_bytes())
overrides = sys.argv[1:]
args = dict(o.split("=", 1) for o in overrides)
run = Path("out", args["method"], args["dataset.name"], "2026-01-01-00-00-00-" + args["common.seed"])
(run / ".hydra").mkdir(parents=True)
(run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\\n" for o in overrides))
seed = int(args["common.seed"])
results = {
    str(r): {"all_clients": {"test": {"loss": "1.0 -> 0.0", "accuracy": f"{10 * r + seed}.50% -> 0.00%"}}}
    for r in range(1, int(args["common.global_epoch"]) + 1)
}
log = "==================== FedAvg Experiment Results: ====================\\n" + json.dumps(results, indent=4)
(run / "main.log").write_text(log + "\\n" + str(len(partition["data_indices"])) + " clients\\n")
(run / "metrics.csv").write_text(f"epoch,accuracy_test_before,accuracy_test_after\\n0,{5 + seed}.25,50.0\\n")
"""


def test_runs_flbench_from_a_linked_root_and_reads_each_seed_once(tmp_path):
    checkout = tmp_path / "FL-bench"
    for folder in ("src/utils", "src/server", "config", "data/utils"):
        (checkout / folder).mkdir(parents=True)
    (checkout / "src" / "utils" / "constants.py").write_text('DATA_MEAN = {"mnist": [0.1307]}\nDATA_STD = {}\n')
    (checkout / "main.py").write_text(FAKE_MAIN)
    data = federation(tmp_path)
    cfg = parity.load_config(ROOT / "configs" / "fedavg.yaml", ["federation.rounds=2"])
    args = parity.flbench_args(cfg, parity.METHODS["fedavg"])
    out = tmp_path / "out"
    side = parity.FlbenchSide(checkout, Path(sys.executable), lambda: data, args, 2, out)
    side.round_zero = True
    assert side.accuracies() is None
    assert side.start(1).wait() == 0, (out / "flbench.log").read_text()
    assert side.accuracies() == [{0: 5.25, 1: 10.5, 2: 20.5}, {0: 6.25, 1: 11.5, 2: 21.5}]
    assert (out / "flbench" / "root" / "src").resolve() == checkout / "src"
    assert not (checkout / "data" / "mnist").exists()  # the checkout is left as it was
    # Finished runs of the same settings are read, not run again; other settings are not taken for them.
    again = parity.FlbenchSide(checkout, Path(sys.executable), lambda: data, args, 2, out)
    assert "plfl_launch.py" not in " ".join(again.command)
    other = parity.FlbenchSide(checkout, Path(sys.executable), lambda: data, {**args, "optimizer.lr": "0.1"}, 1, out)
    assert other.accuracies() is None and "plfl_launch.py" in " ".join(other.command)
