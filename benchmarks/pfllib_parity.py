"""A method in plfl beside the same method in PFLlib on one federation: per-round accuracy, gaps, largest gap.

Usage: python benchmarks/pfllib_parity.py --pfllib PATH/TO/PFLlib --method NAME [--rounds 5] [--seeds 1]
       [--data DIR] [--tolerance 1.0] [--from-round 3] [--out DIR] [key=value ...]

PFLlib (https://github.com/TsingZ0/PFLlib) is the code behind FedALA's baselines. This script runs the
user's own checkout of it (``system/main.py``, on the CPU) and ``plfl fit --config configs/NAME.yaml`` on
the same federation: ``--data``, a folder in PFLlib's format (``train/`` and ``test/`` with one ``.npz``
per client; default the FedALA MNIST Dir(0.1) federation in ``../shared/data``). Both use plfl's 4-layer
CNN (PFLlib's ``FedAvgCNN``), and PFLlib gets every setting from plfl's resolved config: batch size, lr,
local epochs, join ratio, rounds and the method's own keys (``METHODS``; ``--mapping`` prints the
table). ``key=value`` overrides change plfl's config and so both sides. PFLlib drops each client's incomplete
last batch; plfl trains on it unless ``federation.drop_last=true`` is given.

Both report the accuracy of each client's evaluated model on its own test split, pooled over all test
samples (PFLlib's "Averaged Test Accuracy"), after r rounds, before the next local training. PFLlib's
pFedMe evaluates its global model there, so plfl's ``global_accuracy`` is set beside it; PFLlib's FedPHP
evaluates each client's model right after its local training, so its round r is set beside plfl's r + 1
(Ditto's server prints its global model's accuracy, then the personal models', which are compared). Seeds:
plfl runs ``federation.seed`` 0..K−1; PFLlib runs ``--times K`` in one process, or, when some of its runs
are already in ``DIR``, only the missing ones in a new process (``pfllib-2.log``, …). PFLlib seeds torch
with 0 when its process starts and again as it creates each client, so each process's first run starts from
plfl's seed-0 CNN and all its later runs from one other CNN; it does not seed NumPy, which orders its clients
each round, so its batch orders and accuracies differ from run to run.

Prints a Markdown table: round, plfl and PFLlib in % (mean ± sample std over seeds), plfl − PFLlib in
percentage points; then the largest |gap| from ``--from-round`` on (earlier rounds are dominated by each
side's own random initial model and batch order) and exits with status 1 when it exceeds
``--tolerance``. ``DIR/parity.csv`` keeps the table. A side whose finished output in ``DIR`` was run with
the same settings is read, not run again; both sides run at once, each with half the idle CPUs this process may
use (its affinity mask, e.g. ``taskset``).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf
from parity_common import (
    ROOT,
    Flag,
    PlflSide,
    Side,
    add_arguments,
    compare,
    plfl_config,
    print_table,
    run_missing,
)

from plfl.config import load_config
from plfl.errors import PlflError


@dataclass(frozen=True)
class Pairing:
    """A plfl method and its PFLlib algorithm: the method's flags and the plfl overrides that match PFLlib."""

    algorithm: str
    flags: tuple[Flag, ...] = ()
    overrides: tuple[str, ...] = ()
    note: str = ""
    column: str = "accuracy"  # plfl's metrics.csv column that measures what PFLlib's accuracy does
    round_offset: int = 0  # PFLlib's round r is plfl's round r + round_offset
    evaluations: int = 1  # accuracies PFLlib prints per round; the last is compared
    after_last: int = 0  # accuracies PFLlib prints after its last round (FedBABU's fine-tuned models), not compared


def _epochs(cfg: DictConfig) -> int:
    if cfg.federation.local_steps is not None:
        raise PlflError("PFLlib trains local epochs, not steps: remove federation.local_steps.")
    return cfg.federation.local_epochs or 1


def _half(epochs: int) -> int:
    if epochs % 2:
        raise PlflError(f"PFLlib's Per-FedAvg trains twice per local epoch: federation.local_epochs={epochs} is odd.")
    return epochs // 2


def _whole(value: float, key: str) -> int:
    if not float(value).is_integer():
        raise PlflError(f"PFLlib takes whole numbers only: {key}={value}.")
    return int(value)


SHARED = (
    Flag("batch_size", "federation.batch_size"),
    Flag("local_learning_rate", "federation.lr"),
    Flag("local_epochs", "federation.local_epochs", lambda epochs, cfg: _epochs(cfg)),
    Flag("join_ratio", "federation.join_ratio"),
    Flag("global_rounds", "federation.rounds"),
)

METHODS = {
    "fedavg": Pairing("FedAvg"),
    "local": Pairing("Local"),
    "fedala": Pairing(
        "FedALA",
        (
            Flag("eta", "method.eta"),
            Flag("rand_percent", "method.s", lambda s, cfg: _whole(s, "method.s")),
            Flag("layer_idx", "method.p"),
        ),
        note="PFLlib's ALA threshold (0.1) and loss window (10) are fixed: method.threshold, method.num_pre_loss",
    ),
    "fedprox": Pairing("FedProx", (Flag("mu", "method.mu"),)),
    "perfedavg": Pairing(
        "PerAvg",
        (
            Flag(
                "local_epochs",
                "federation.local_epochs",
                lambda epochs, cfg: _half(_epochs(cfg)),
                "PFLlib trains each client twice a round",
            ),
        ),
        ("federation.local_epochs=2",),
        note="PFLlib's α and β are both the lr: method.alpha and method.beta null",
    ),
    "ditto": Pairing(
        "Ditto",
        (
            Flag("mu", "method.lam"),
            Flag("plocal_epochs", "method.personal_epochs", lambda epochs, cfg: epochs or _epochs(cfg)),
        ),
        note="PFLlib prints its global model's accuracy, then the personal models'; the second is compared",
        evaluations=2,
    ),
    "pfedme": Pairing(
        "pFedMe",
        (
            Flag("lamda", "method.lam"),
            Flag("K", "method.k"),
            Flag("p_learning_rate", "method.personal_lr"),
            Flag("beta", "method.beta"),
        ),
        note="PFLlib's accuracy is its global model's, so plfl's global_accuracy is compared",
        column="global_accuracy",
    ),
    "fedrep": Pairing("FedRep", (Flag("plocal_epochs", "method.head_epochs"),)),
    "lgfedavg": Pairing("LG-FedAvg"),
    "apfl": Pairing(
        "APFL",
        (Flag("alpha", "method.alpha"),),
        note="PFLlib steps α by the lr: method.alpha_lr null; PFLlib steps v on f(v) (plfl: on f(v̄)), adds "
        "0.02α to α's gradient, keeps v̄ as v and evaluates v̄ with the client's trained w (plfl/methods/apfl.py)",
    ),
    "fedrod": Pairing(
        "FedROD",
        note="PFLlib counts a client's classes over one shuffled pass that drops its last incomplete batch",
    ),
    "fedper": Pairing("FedPer"),
    "fedbabu": Pairing(
        "FedBABU",
        (Flag("fine_tuning_epochs", "method.fine_tuning_epochs"),),
        note="compared: the global model (the global body under the initial head) of every round; both fine-tune "
        "after the last round, PFLlib from each client's own last local training",
        column="global_accuracy",
        after_last=1,
    ),
    "scaffold": Pairing("SCAFFOLD", (Flag("server_learning_rate", "method.server_lr"),)),
    "feddyn": Pairing(
        "FedDyn",
        (Flag("alpha", "method.alpha"),),
        ("method.penalty=unsquared",),
        note="PFLlib's proximal term is α/2‖θ − θ^{t−1}‖, not squared: plfl's side takes method.penalty=unsquared",
    ),
    "moon": Pairing("MOON", (Flag("mu", "method.mu"), Flag("tau", "method.tau"))),
    "fedpac": Pairing(
        "FedPAC",
        (Flag("lamda", "method.lam"),),
        note="PFLlib's feature statistics and prototypes leave out each client's last incomplete batch; its server "
        "combines heads into the uploaded modules themselves, so later clients combine partly combined heads",
    ),
    "fedproto": Pairing(
        "FedProto",
        (Flag("lamda", "method.lam"),),
        note="PFLlib classifies by the nearest global prototype (plfl's method.inference=prototypes) and "
        "reports 0 % at round 0, before any prototype exists, where plfl evaluates the initial model",
    ),
    "fedbn": Pairing(
        "FedBN",
        overrides=("model.batch_norm=false", "method.name=fedavg"),
        note="PFLlib's MNIST CNN has no BatchNorm layer, so its FedBN is FedAvg; plfl's side is FedAvg too",
    ),
    "fedamp": Pairing(
        "FedAMP", (Flag("alphaK", "method.alpha_k"), Flag("lamda", "method.lam"), Flag("sigma", "method.sigma"))
    ),
    "fedfomo": Pairing("FedFomo", (Flag("M", "method.m"),), note="PFLlib's validation share (0.2) is fixed"),
    "apple": Pairing(
        "APPLE",
        (
            Flag("dr_learning_rate", "method.dr_lr"),
            Flag("mu", "method.mu"),
            Flag(
                "L",
                "method.schedule_rounds",
                lambda rounds, cfg: (rounds or cfg.federation.rounds) / cfg.federation.rounds,
                "a share of the rounds in PFLlib (null: all)",
            ),
        ),
    ),
    "feddbe": Pairing(
        "FedDBE",
        (Flag("momentum", "method.mu"), Flag("kl_weight", "method.kappa")),
        note="PFLlib's loader drops each client's last incomplete batch, in the initialization period too",
    ),
    "fedcp": Pairing(
        "FedCP",
        (Flag("lamda", "method.lam"),),
        note="PFLlib's Gumbel-softmax τ (1) is fixed: method.tau; PFLlib draws the policy's Gumbel noise at its "
        "test too: method.evaluation=gumbel",
    ),
    "fedphp": Pairing(
        "FedPHP",
        (Flag("mu", "method.mu"), Flag("lamda", "method.lam")),
        note="PFLlib's μ_t rises over all rounds: method.inheritance_rounds null; PFLlib evaluates each "
        "client's model after its local training, so its round r is plfl's round r + 1",
        round_offset=1,
    ),
    "fedas": Pairing(
        "FedAS",
        note="PFLlib's alignment (one epoch, batches of 16, SGD at 0.01) is fixed: method.align_epochs, "
        "method.align_batch_size, method.align_lr; its prototypes, alignment and Fisher pass leave out each "
        "client's last incomplete batch",
    ),
    "gpfl": Pairing(
        "GPFL",
        (Flag("lamda", "method.lam"), Flag("mu", "method.mu")),
        note="PFLlib counts a client's class frequencies over one shuffled pass that drops its last incomplete batch",
    ),
}


def mapping_table() -> str:
    """The Markdown table of every method's PFLlib flags, the plfl keys they come from and plfl's defaults."""
    lines = [
        "| method | PFLlib `-algo` | PFLlib flag | plfl key | plfl value | PFLlib value | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, pairing in METHODS.items():
        cfg = load_config(ROOT / "configs" / f"{name}.yaml", list(pairing.overrides))
        if not pairing.flags:
            lines.append(f"| {name} | {pairing.algorithm} | – | – | – | – | {pairing.note} |")
        for i, flag in enumerate(pairing.flags):
            value = OmegaConf.select(cfg, flag.key)
            note = "; ".join(n for n in (flag.note, pairing.note if i == 0 else "") if n)
            lines.append(
                f"| {name if i == 0 else ''} | {pairing.algorithm if i == 0 else ''} | `--{flag.name}` | "
                f"`{flag.key}` | {value} | {flag.convert(value, cfg)} | {note} |"
            )
    return "\n".join(lines)


def pfllib_args(cfg: DictConfig, pairing: Pairing, dataset: str, num_clients: int, seeds: int) -> dict[str, str]:
    """PFLlib's ``main.py`` arguments (long names, as its log echoes them) for plfl's resolved ``cfg``."""
    own = {f.name for f in pairing.flags}
    args = {
        "dataset": dataset,
        "model": "CNN",
        "algorithm": pairing.algorithm,
        "device": "cpu",
        "num_clients": str(num_clients),
        "eval_gap": "1",
        "times": str(seeds),
    }
    for flag in tuple(f for f in SHARED if f.name not in own) + pairing.flags:
        args[flag.name] = str(flag.convert(OmegaConf.select(cfg, flag.key), cfg))
    return args


ECHO = re.compile(r"^(\w+) = (.*)$")
RUN = re.compile(r"Running time: (\d+)th")
ROUND = re.compile(r"Round number: (\d+)")
LATER_LOG = re.compile(r"pfllib-(\d+)\.log")
ACCURACY = re.compile(r"Average(?:d)? Test Accuracy: ([0-9.]+)")  # pFedMe's server says "Average"


def read_pfllib_log(text: str) -> tuple[dict[str, str], list[dict[int, list[float]]]]:
    """PFLlib's echoed arguments and, per run (``--times``), round → the test accuracies (%) printed for it,
    in order (Ditto's server prints its global model's, then the personalized models').

    Raises:
        PlflError: an accuracy line comes before any round or run line (not a PFLlib ``main.py`` log).
    """
    echoed, runs, current = {}, [], None
    for line in text.splitlines():
        if (m := ECHO.match(line)) and not runs:
            echoed[m.group(1)] = m.group(2)
        elif RUN.search(line):
            runs.append({})
        elif m := ROUND.search(line):
            current = int(m.group(1))
        elif m := ACCURACY.search(line):
            if not runs or current is None:
                raise PlflError("a 'Test Accuracy' line before any round: this is not PFLlib's main.py log")
            runs[-1].setdefault(current, []).append(100 * float(m.group(1)))
    return echoed, runs


def _same(echoed: dict[str, str], args: dict[str, str]) -> bool:
    def value(text: Optional[str]) -> object:
        try:
            return float(text)
        except (TypeError, ValueError):
            return text

    return all(value(echoed.get(k)) == value(v) for k, v in args.items())


class PfllibSide(Side):
    stop_when_complete = True  # PFLlib trains once more after its last evaluation

    def __init__(self, pfllib: Path, data: Path, dataset: str, args: dict[str, str], out: Path, pairing: Pairing):
        main = pfllib / "system" / "main.py"
        if not main.is_file():
            raise PlflError(
                f"{main} does not exist: pass --pfllib the root of a PFLlib checkout (it has system/main.py)."
            )
        work = out / "pfllib"
        _link_dataset(data, work / "dataset" / dataset)
        (work / "system").mkdir(parents=True, exist_ok=True)
        self.out, self.seeds = out, int(args["times"])
        self.settings = {name: value for name, value in args.items() if name != "times"}
        self.offset, self.evaluations, self.after_last = pairing.round_offset, pairing.evaluations, pairing.after_last
        # Only the runs still missing are started, in a process of their own with a log of its own.
        missing = {**args, "times": str(max(1, self.seeds - len(self._finished_runs())))}
        flags = [token for name, value in missing.items() for token in (f"--{name}", value)]
        logs = self._logs()
        last = max((int(m.group(1)) for log in logs if (m := LATER_LOG.fullmatch(log.name))), default=1)
        log = out / (f"pfllib-{last + 1}.log" if logs else "pfllib.log")
        super().__init__([sys.executable, str(main), *flags], work / "system", log)

    def accuracies(self) -> Optional[list[dict[int, float]]]:
        """Per seed, round → accuracy (%); None unless the logs hold that many finished runs of these settings."""
        runs = self._finished_runs()[: self.seeds]
        if len(runs) < self.seeds:
            return None
        return [{r + self.offset: accuracies[self.evaluations - 1] for r, accuracies in run.items()} for run in runs]

    def _logs(self) -> list[Path]:
        """``pfllib.log``, then ``pfllib-2.log``, … (one per PFLlib process), those that exist."""
        numbered = {int(m.group(1)): log for log in self.out.iterdir() if (m := LATER_LOG.fullmatch(log.name))}
        return [log for log in [self.out / "pfllib.log", *map(numbered.get, sorted(numbered))] if log.is_file()]

    def _finished_runs(self) -> list[dict[int, list[float]]]:
        """The runs, log by log, that printed every round and were run with these settings."""
        last = int(self.settings["global_rounds"])
        printed = {r: self.evaluations + (self.after_last if r == last else 0) for r in range(last + 1)}
        runs = []
        for log in self._logs():
            echoed, log_runs = read_pfllib_log(log.read_text(errors="replace"))
            if _same(echoed, self.settings):
                runs += [run for run in log_runs if all(len(run.get(r, ())) == n for r, n in printed.items())]
        return runs


def _link_dataset(data: Path, target: Path) -> None:
    """PFLlib's reader wants ``train/{i}.npz``; FedALA's files are ``train/train{i}_.npz``: link either."""
    for split in ("train", "test"):
        (target / split).mkdir(parents=True, exist_ok=True)
        for file in (data / split).glob("*.npz"):
            index = re.fullmatch(rf"(?:{split})?(\d+)_?\.npz", file.name)
            if index is None:
                raise PlflError(f"{file} is not a PFLlib client file ({split}/{{i}}.npz or {split}/{split}{{i}}_.npz).")
            link = target / split / f"{index.group(1)}.npz"
            link.unlink(missing_ok=True)
            link.symlink_to(file.resolve())


def _clients(data: Path) -> int:
    count = len(list((data / "train").glob("*.npz")))
    if not count:
        raise PlflError(f"{data}/train has no .npz files: pass --data a federation in PFLlib's format.")
    return count


def run(args: argparse.Namespace) -> int:
    pairing = METHODS[args.method]
    config, overrides, cfg = plfl_config(args, pairing.overrides)
    out = args.out or ROOT / "runs" / "pfllib-parity" / args.method
    out.mkdir(parents=True, exist_ok=True)
    sides = [
        PlflSide(config, overrides, cfg, args.seeds, out, pairing.column),
        PfllibSide(
            args.pfllib,
            args.data,
            args.dataset,
            pfllib_args(cfg, pairing, args.dataset, _clients(args.data), args.seeds),
            out,
            pairing,
        ),
    ]
    run_missing(sides)
    plfl, pfllib = (side.accuracies() for side in sides)
    rows, largest = compare(plfl, pfllib, args.from_round)
    heading = f"{args.method} ({pairing.algorithm} in PFLlib)"
    print_table(args, heading, pairing.column, "PFLlib", rows, largest, out)
    return 1 if largest > args.tolerance else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pfllib", type=Path, help="root of a PFLlib checkout (it has system/main.py)")
    parser.add_argument("--dataset", default="MNIST", help="PFLlib's data set name (picks its CNN's input size)")
    add_arguments(parser, sorted(METHODS), "PFLlib (--times K)", "runs/pfllib-parity")
    args = parser.parse_args()
    try:
        if args.mapping:
            print(mapping_table())
            return
        if args.pfllib is None or args.method is None:
            parser.error("--pfllib and --method are required")
        sys.exit(run(args))
    except PlflError as e:
        sys.exit(f"pfllib_parity.py: {e}")


if __name__ == "__main__":
    main()
