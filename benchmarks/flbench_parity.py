"""A method in plfl beside the same method in FL-bench on one federation: per-round accuracy, gaps, largest gap.

Usage: python benchmarks/flbench_parity.py --flbench PATH/TO/FL-bench --python PATH/TO/python --method NAME
       [--rounds 5] [--seeds 1] [--data DIR] [--tolerance 1.0] [--from-round 3] [--out DIR] [key=value ...]

FL-bench (https://github.com/KarhouTam/FL-bench) is a benchmark of federated methods. This script runs the user's
own checkout of it (its ``main.py``, on the CPU, serially, with ``--python``: FL-bench's own interpreter, with
hydra-core, torch, torchvision, ray, rich, pandas, scikit-learn and pynvml) and ``plfl fit --config
configs/NAME.yaml`` on the same federation: ``--data``, a folder in PFLlib's format (default the FedALA MNIST
Dir(0.1) federation in ``../shared/data``). FL-bench has no reader for such a folder and cannot download MNIST
here, so the script writes FL-bench's data folder for its ``mnist`` data set from the clients plfl reads
(:func:`write_flbench_mnist`): MNIST's raw files (``MNIST/raw``, the idx format that torchvision's reader takes)
holding every client's training samples then every client's test samples, ``partition.pkl`` naming each client's
samples (FL-bench's ``sample`` split: every client trains and is tested, on exactly its plfl splits) and
``args.json``. The folder is ``DIR/flbench/root/data/mnist``: ``DIR/flbench/root`` is the checkout seen through
links (``main.py``, ``config``, ``src``, ``data/utils``), so FL-bench's root, which it takes from its own files'
paths, holds this data and the checkout is left as it is.

Same inputs: PFLlib's images are ``(x/255 − 0.5)/0.5`` of 8-bit pixels; FL-bench's ``mnist`` divides the pixels by
255 and normalises by MNIST's mean and std (0.1307, 0.3015). The pixels are written back exactly, and a small
launcher (``DIR/flbench/root/plfl_launch.py``) sets FL-bench's normalisation of ``mnist`` to (0.5, 0.5) before it
runs ``main.py``, so both sides train on the same tensors. Same model: FL-bench's ``avgcnn`` (``FedAvgCNN``) is
plfl's ``cnn`` (PFLlib's ``FedAvgCNN``): conv 5×5 (32) → ReLU → max-pool 2 → conv 5×5 (64) → ReLU → max-pool 2 →
linear 1024→512 → ReLU → linear 512→10, created in that order, so that a seed gives both sides the same initial
model (FL-bench seeds torch with ``common.seed`` right before creating it; plfl's seed s with s). Same training:
SGD (no weight decay, dampening or Nesterov; ``federation.momentum``), ``federation.lr``, batch size, local epochs,
join ratio and rounds from plfl's resolved config, and the method's own keys (``METHODS``; ``--mapping`` prints the
table). ``key=value`` overrides change plfl's config and so both sides. FL-bench skips a batch of one sample (its
BatchNorm guard): a client whose training split leaves a last batch of one trains on one sample less.

Evaluation point: plfl reports each client's evaluated (personalized) model on its own test split, pooled over
all test samples, after r rounds, before the next local training. FL-bench's ``test_client_models`` does the same
when its client-side test runs every round (``common.test.client.interval=1``, test split only, no fine-tuning:
``finetune_epoch=0``; its "before" figure, over every client, its Metrics pooling all their predictions); it runs
after round r's aggregation, on each client's model as the method's ``package``/``set_parameters`` give it with
``testing`` set (FedAS: the client's model from its last local training, as plfl's). Its log prints these
accuracies, per round, with two decimals: the table's FL-bench column is rounded to 0.01 %. Round 0 (the initial
model) has no such test in FL-bench; for methods whose clients evaluate the received model unchanged
(``Pairing.round_zero``) it is read from round 1's client-side evaluation before local training (``metrics.csv``,
``accuracy_test_before`` of epoch 0), which covers the clients sampled in round 1: all when the join ratio is 1.

Differences that remain (each pairing's note; ``--mapping``): FL-bench's CFL averages a cluster's updates, and takes
the ε1 test's mean update, with equal weights, as the authors' code does; plfl's side takes them,
``method.update_weights=equal`` (plfl's default weights them by training samples, as the paper; on FedALA's
unbalanced MNIST federation, 499 to 6,189 samples a client, the two weightings differ by up to 12.6 points in the
rounds before a split, where CFL is FedAvg). FL-bench's FedAS averages the whole model, the head too, and every
client starts its alignment and training from the global head: it has no personal head (plfl's and PFLlib's FedAS
keep each client's head); its alignment loss is the squared distance of each class's batch mean feature to the class
prototype (plfl: the mean over the class's samples of each one's squared distance), on the training batches (plfl's
``method.align_batch_size`` is set to the batch size). Its accuracy is within a point of plfl's all the same (0.84
at round 3, 0.15 at round 5, one seed): both evaluate each client's model after its local training, which fits the
head to its classes.

Seeds: plfl runs ``federation.seed`` 0..K−1, FL-bench ``common.seed`` 0..K−1, one process per seed
(``DIR/flbench/seed<s>``). FL-bench seeds Python, NumPy and torch once; the two sides' batch orders and client
orders differ. Prints a Markdown table: round, plfl and FL-bench in % (mean ± sample std over seeds), plfl −
FL-bench in percentage points; then the largest |gap| from ``--from-round`` on, and exits with status 1 when it
exceeds ``--tolerance``. ``DIR/parity.csv`` keeps the table. A side whose finished output in ``DIR`` was run with
the same settings is read, not run again; both sides run at once, each with half the idle CPUs.
"""

from __future__ import annotations

import argparse
import csv
import json
import pickle
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from parity_common import (
    ROOT,
    Flag,
    PlflSide,
    Side,
    add_arguments,
    compare,
    flag_values,
    plfl_config,
    print_table,
    run_missing,
)

from plfl.config import load_config
from plfl.data.federated import FederatedData
from plfl.data.loading import load_federated_data
from plfl.errors import PlflError


@dataclass(frozen=True)
class Pairing:
    """A plfl method and its FL-bench method: the method's settings (``++method.key=value``), the plfl keys that
    FL-bench fixes (``requires``: key, value, why; set on plfl's side) or ties to another plfl key (``tied``: key,
    the key whose value it takes, why)."""

    method: str  # FL-bench's method=, src/server/<method>.py
    flags: tuple[Flag, ...] = ()
    requires: tuple[tuple[str, object, str], ...] = ()
    tied: tuple[tuple[str, str, str], ...] = ()
    note: str = ""
    round_zero: bool = True  # round 0 from round 1's evaluation before local training (the received model)
    checked: bool = True  # False: inferred from FL-bench alone; plfl's keys still to be checked against plfl's method


def _epochs(cfg: DictConfig) -> int:
    if cfg.federation.local_steps is not None:
        raise PlflError("FL-bench trains local epochs, not steps: remove federation.local_steps.")
    return cfg.federation.local_epochs or 1


def _at_least(size: int) -> Callable[[object, DictConfig], object]:
    """plfl's ``min_cluster_size`` (split clusters of at least m clients) as FL-bench's (of more than m)."""
    return lambda m, cfg: int(m) - size


def _capacity(fraction: object, cfg: DictConfig) -> int:
    if fraction != 1.0:
        raise PlflError(
            f"method.capacity={fraction}: FL-bench's kNN-Per keeps a fixed number of samples, not a fraction; "
            "only 1.0 (all of them) has a match."
        )
    return 10**9


SHARED = (
    Flag("optimizer.lr", "federation.lr"),
    Flag("optimizer.momentum", "federation.momentum"),
    Flag("common.batch_size", "federation.batch_size"),
    Flag("common.local_epoch", "federation.local_epochs", lambda epochs, cfg: _epochs(cfg)),
    Flag("common.join_ratio", "federation.join_ratio"),
    Flag("common.global_epoch", "federation.rounds"),
)

# FL-bench's settings that no plfl key sets: its model, plain SGD on the CPU, the client-side test of every client's
# model on its test split every round, no server-side test, no plot (matplotlib), metrics.csv and main.log kept.
FIXED = {
    "dataset.name": "mnist",
    "model.name": "avgcnn",
    "model.use_torchvision_pretrained_weights": "false",
    "optimizer.name": "sgd",
    "optimizer.weight_decay": "0",
    "optimizer.dampening": "0",
    "optimizer.nesterov": "false",
    "lr_scheduler.name": "null",
    "mode": "serial",
    "common.use_cuda": "false",
    "common.buffers": "global",
    "common.straggler_ratio": "0",
    "common.client_side_evaluation": "true",
    "common.test.client.interval": "1",
    "common.test.client.finetune_epoch": "0",
    "common.test.client.train": "false",
    "common.test.client.val": "false",
    "common.test.client.test": "true",
    "common.test.server.interval": "-1",
    "common.monitor": "null",
    "common.save_log": "true",
    "common.save_metrics": "true",
    "common.save_learning_curve_plot": "false",
    "common.save_model": "false",
}

METHODS = {
    "fedavg": Pairing("fedavg"),
    "cfl": Pairing(
        "cfl",
        (
            Flag("++cfl.eps_1", "method.eps1"),
            Flag("++cfl.eps_2", "method.eps2"),
            Flag("++cfl.min_cluster_size", "method.min_cluster_size", _at_least(1), "FL-bench splits more than m"),
            Flag("++cfl.start_clustering_round", "method.warmup_rounds"),
        ),
        requires=(
            ("method.linkage", "complete", "FL-bench bipartitions by complete linkage"),
            ("method.gamma_max", 0.0, "FL-bench has no γ test"),
            ("method.update_weights", "equal", "FL-bench averages a cluster's updates with equal weights"),
        ),
    ),
    "fedas": Pairing(
        "fedas",
        (Flag("++fedas.alignment_lr", "method.align_lr"), Flag("++fedas.alignment_epoch", "method.align_epochs")),
        tied=(("method.align_batch_size", "federation.batch_size", "FL-bench aligns on its training batches"),),
        note="FL-bench's FedAS averages the whole model, head included, and sends it back: its clients have no "
        "personal head; its alignment loss is the squared distance of each class's batch mean feature to the "
        "prototype (plfl: the mean of each sample's squared distance)",
        round_zero=False,
    ),
    "fedem": Pairing(
        "fedem",
        (Flag("++fedem.n_learners", "method.components"),),
    ),
    "knnper": Pairing(
        "knnper",
        (
            Flag("++knnper.k", "method.neighbours"),
            Flag("++knnper.scale", "method.scale"),
            Flag("++knnper.weight", "method.weight"),
            Flag("++knnper.capacity", "method.capacity", _capacity, "FL-bench keeps a count of samples"),
        ),
        requires=(
            ("method.interpolate", "logits", "FL-bench mixes the kNN probabilities with the model's logits"),
            ("method.weight_grid", [], "FL-bench takes knnper.weight as it is"),
        ),
        note="FL-bench's kNN-Per needs faiss (faiss-cpu) in its environment; its round-1 evaluation before training "
        "is the model's alone, without the datastore",
        round_zero=False,
    ),
}


def mapping_table() -> str:
    """The Markdown table of every method's FL-bench settings, the plfl keys they come from and plfl's defaults
    (a method whose mapping is still to be checked is listed without values: "?")."""
    lines = [
        "| method | FL-bench `method=` | FL-bench setting | plfl key | plfl value | FL-bench value | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, pairing in METHODS.items():
        path = ROOT / "configs" / f"{name}.yaml"
        cfg = load_config(path, _required(pairing)) if pairing.checked else None
        rows = [(f"`{f.name}`", f"`{f.key}`", f, f.note) for f in pairing.flags]
        rows += [("–", f"`{key}`", value, why) for key, value, why in pairing.requires]
        rows += [("–", f"`{key}`", f"= `{source}`", why) for key, source, why in pairing.tied]
        if not rows:
            lines.append(f"| {name} | {pairing.method} | – | – | – | – | {pairing.note} |")
        for i, (setting, key, value, why) in enumerate(rows):
            plfl_value = flbench_value = "?"
            if isinstance(value, Flag) and cfg is not None:
                plfl_value = OmegaConf.select(cfg, value.key)
                flbench_value = value.convert(plfl_value, cfg)
            elif not isinstance(value, Flag):
                plfl_value, flbench_value = value, "–"
            note = "; ".join(n for n in (why, pairing.note if i == 0 else "") if n)
            lines.append(
                f"| {name if i == 0 else ''} | {pairing.method if i == 0 else ''} | {setting} | {key} | "
                f"{plfl_value} | {flbench_value} | {note} |"
            )
    return "\n".join(lines)


def _required(pairing: Pairing) -> list[str]:
    """plfl's overrides for the keys FL-bench fixes."""
    return [f"{key}={json.dumps(value) if isinstance(value, list) else value}" for key, value, _ in pairing.requires]


def _value(cfg: DictConfig, key: str) -> object:
    value = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def flbench_args(cfg: DictConfig, pairing: Pairing) -> dict[str, str]:
    """FL-bench's ``main.py`` settings (Hydra's ``key=value``, without the seed) for plfl's resolved ``cfg``."""
    return {"method": pairing.method, **FIXED, **flag_values(SHARED + pairing.flags, cfg)}


# FL-bench's main.py run with FL-bench's normalisation of `mnist` set to PFLlib's, from the linked root beside it.
LAUNCHER = '''"""Written by plfl's benchmarks/flbench_parity.py: FL-bench's main.py from this folder, whose src/,
config/ and data/utils/ link to an FL-bench checkout, with MNIST normalised as PFLlib does ((x/255 - 0.5)/0.5)."""
import runpy
import sys
from pathlib import Path

root = Path(__file__).parent
sys.path.insert(0, str(root))
from src.utils import constants  # noqa: E402

constants.DATA_MEAN["mnist"], constants.DATA_STD["mnist"] = [0.5], [0.5]
sys.argv[0] = str(root / "main.py")
runpy.run_path(str(root / "main.py"), run_name="__main__")
'''


def _idx(array: np.ndarray) -> bytes:
    """``array`` (uint8) in the idx format of MNIST's raw files: magic (0, 0, 8 = ubyte, dims), big-endian sizes."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def _pixels(x: torch.Tensor) -> np.ndarray:
    """The 8-bit pixels p of images ``x`` = (p/255 − 0.5)/0.5 (float32, (n, 1, 28, 28)) → uint8 (n, 28, 28).

    Raises:
        PlflError: some image is not of that form (FL-bench's ``mnist`` reads 8-bit pixels only).
    """
    pixels = torch.round((x.double() + 1) * 127.5).clamp(0, 255).to(torch.uint8)
    if not torch.equal((pixels.float() / 255 - 0.5) / 0.5, x):
        raise PlflError(
            "the federation's images are not (p/255 - 0.5)/0.5 of 8-bit pixels p, as PFLlib writes MNIST: "
            "FL-bench's mnist reads 8-bit pixels only."
        )
    return pixels[:, 0].numpy()


def write_flbench_mnist(data: FederatedData, target: Path) -> list[dict[str, list[int]]]:
    """FL-bench's data folder for its ``mnist`` data set (``target``) holding exactly ``data``'s clients: the
    samples in ``MNIST/raw`` (train files: every client's training then validation samples, client by client;
    t10k files: every client's test samples), ``partition.pkl`` (``sample`` split, every client in train, val and
    test; client i's indices into FL-bench's train-then-t10k data set) and ``args.json``. Returns the indices.

    Raises:
        PlflError: the samples are not 1×28×28 images of (p/255 − 0.5)/0.5 of 8-bit pixels, or a label is not 0..9.
    """
    if data.input_shape != (1, 28, 28) or data.num_classes != 10:
        raise PlflError(
            f"the federation's samples are {data.input_shape} in {data.num_classes} classes: FL-bench's side runs its "
            "mnist data set (1×28×28 images, 10 classes)."
        )
    trains = [torch.cat([c.x_train, c.x_val]) for c in data.clients]
    train_labels = [torch.cat([c.y_train, c.y_val]) for c in data.clients]
    n_train = sum(len(y) for y in train_labels)
    indices, train_at, test_at = [], 0, n_train
    for c in data.clients:
        indices.append(
            {
                "train": list(range(train_at, train_at + c.num_train)),
                "val": list(range(train_at + c.num_train, train_at + c.num_train + c.num_val)),
                "test": list(range(test_at, test_at + c.num_test)),
            }
        )
        train_at, test_at = train_at + c.num_train + c.num_val, test_at + c.num_test
    raw = target / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, images, labels in (
        ("train", trains, train_labels),
        ("t10k", [c.x_test for c in data.clients], [c.y_test for c in data.clients]),
    ):
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(_idx(_pixels(torch.cat(images))))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(_idx(torch.cat(labels).numpy().astype(np.uint8)))
    clients = list(range(len(data.clients)))
    separation = {"train": clients, "val": clients, "test": clients, "total": len(clients)}
    (target / "partition.pkl").write_bytes(pickle.dumps({"separation": separation, "data_indices": indices}))
    args = {"dataset": "mnist", "client_num": len(clients), "split": "sample", "monitor_window_name_suffix": "plfl"}
    (target / "args.json").write_text(json.dumps(args, indent=4))
    return indices


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target.resolve())


ACCURACY = re.compile(r"([0-9.]+)% -> [0-9.]+%")


def read_test_results(text: str) -> dict[int, float]:
    """Round → accuracy (%) of FL-bench's client-side test (all clients, before fine-tuning, test split) from the
    results ``main.log`` prints at its end ({round: {"all_clients": {"test": {"accuracy": "a% -> b%"}}}}); {} while
    the run has not printed them."""
    start = text.find("Experiment Results:")
    start = text.find("{", start) if start >= 0 else -1
    if start < 0:
        return {}
    try:
        results, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError:
        return {}
    rounds = {}
    for r, groups in results.items():
        test = groups.get("all_clients", {}).get("test")
        if test is not None and (m := ACCURACY.search(test["accuracy"])):
            rounds[int(r)] = float(m.group(1))
    return rounds


class FlbenchSide(Side):
    def __init__(
        self,
        flbench: Path,
        python: Path,
        data: Callable[[], FederatedData],
        args: dict[str, str],
        seeds: int,
        out: Path,
    ):
        if not (flbench / "main.py").is_file() or not (flbench / "src" / "server").is_dir():
            raise PlflError(
                f"{flbench / 'main.py'} does not exist: pass --flbench the root of an FL-bench checkout (it has "
                "main.py and src/server/)."
            )
        self.flbench, self.data, self.args, self.seeds = flbench, data, args, seeds
        self.work = out / "flbench"
        self.root = self.work / "root"
        self.round_zero = False
        runs = [
            f"cd {shlex.quote(str(self.work / f'seed{seed}'))}\n"
            + shlex.join([str(python), str(self.root / "plfl_launch.py"), *self.overrides(seed)])
            for seed in range(seeds)
            if self._run_dir(seed) is None
        ]
        super().__init__(["bash", "-ec", "\n".join(runs)], out, out / "flbench.log")

    def overrides(self, seed: int) -> list[str]:
        return [f"{k}={v}" for k, v in self.args.items()] + [f"common.seed={seed}"]

    def start(self, threads: int):
        """Lay out the linked root, write the data folder and the launcher, then run the missing seeds."""
        for name in ("main.py", "config", "src"):
            _link(self.root / name, self.flbench / name)
        _link(self.root / "data" / "utils", self.flbench / "data" / "utils")
        write_flbench_mnist(self.data(), self.root / "data" / "mnist")
        (self.root / "plfl_launch.py").write_text(LAUNCHER)
        for seed in range(self.seeds):
            (self.work / f"seed{seed}").mkdir(parents=True, exist_ok=True)
        return super().start(threads)

    def accuracies(self) -> Optional[list[dict[int, float]]]:
        """Per seed, round → accuracy (%); None unless each seed has a finished run of these settings."""
        runs = [self._run_dir(seed) for seed in range(self.seeds)]
        if None in runs:
            return None
        seeds = []
        for run in runs:
            rounds = read_test_results((run / "main.log").read_text(errors="replace"))
            if self.round_zero:
                with (run / "metrics.csv").open() as f:
                    first = next(csv.DictReader(f))
                rounds[0] = float(first["accuracy_test_before"])
            seeds.append(rounds)
        return seeds

    def _run_dir(self, seed: int) -> Optional[Path]:
        """The newest FL-bench run of ``seed`` with these settings (Hydra's ``.hydra/overrides.yaml``) that printed
        every round's test results."""
        wanted = sorted(self.overrides(seed))
        last = int(self.args["common.global_epoch"])
        for saved in sorted((self.work / f"seed{seed}").glob("out/*/*/*/.hydra/overrides.yaml"), reverse=True):
            run = saved.parent.parent
            if sorted(OmegaConf.to_container(OmegaConf.load(saved))) != wanted or not (run / "main.log").is_file():
                continue
            if last in read_test_results((run / "main.log").read_text(errors="replace")):
                return run
        return None


def run(args: argparse.Namespace) -> int:
    pairing = METHODS[args.method]
    config, overrides, cfg = plfl_config(args, tuple(_required(pairing)))
    tied = [f"{key}={OmegaConf.select(cfg, source)}" for key, source, _ in pairing.tied]
    if tied:
        config, overrides, cfg = plfl_config(args, tuple(_required(pairing) + tied))
    for key, value, why in pairing.requires:
        if _value(cfg, key) != value:
            raise PlflError(f"{key}={OmegaConf.select(cfg, key)}: {why}, so plfl's side needs {key}={value}.")
    for key, source, why in pairing.tied:
        if OmegaConf.select(cfg, key) != OmegaConf.select(cfg, source):
            raise PlflError(f"{key}={OmegaConf.select(cfg, key)}: {why}, so plfl's side needs {key}={source}'s value.")
    if cfg.data.val_fraction:
        raise PlflError("data.val_fraction > 0: FL-bench's side takes the federation once, not per seed's split.")
    out = args.out or ROOT / "runs" / "flbench-parity" / args.method
    out.mkdir(parents=True, exist_ok=True)
    flbench = FlbenchSide(
        args.flbench, args.python, lambda: load_federated_data(cfg.data, 0), flbench_args(cfg, pairing), args.seeds, out
    )
    flbench.round_zero = pairing.round_zero and cfg.federation.join_ratio == 1.0
    sides = [PlflSide(config, overrides, cfg, args.seeds, out, "accuracy"), flbench]
    run_missing(sides)
    plfl, other = (side.accuracies() for side in sides)
    rows, largest = compare(plfl, other, args.from_round)
    print_table(args, f"{args.method} ({pairing.method} in FL-bench)", "accuracy", "FL-bench", rows, largest, out)
    return 1 if largest > args.tolerance else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flbench", type=Path, help="root of an FL-bench checkout (it has main.py and src/)")
    parser.add_argument("--python", type=Path, help="FL-bench's Python interpreter (its own virtual environment)")
    add_arguments(parser, sorted(METHODS), "FL-bench (common.seed)", "runs/flbench-parity")
    args = parser.parse_args()
    try:
        if args.mapping:
            print(mapping_table())
            return
        if args.flbench is None or args.python is None or args.method is None:
            parser.error("--flbench, --python and --method are required")
        sys.exit(run(args))
    except PlflError as e:
        sys.exit(f"flbench_parity.py: {e}")


if __name__ == "__main__":
    main()
