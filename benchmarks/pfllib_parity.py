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
import csv
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from omegaconf import DictConfig, OmegaConf

from plfl.config import load_config
from plfl.cpus import default_threads
from plfl.errors import PlflError
from plfl.report.runs import read_report_run

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "fedala-mnist-dir0.1"


@dataclass(frozen=True)
class Flag:
    """PFLlib's ``--name`` set from plfl's config ``key`` (through ``convert``, for keys counted differently)."""

    name: str
    key: str
    convert: Callable[[object, DictConfig], object] = lambda value, cfg: value
    note: str = ""


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


class Side:
    """One side's command, its output in the comparison's folder, and its per-seed accuracies."""

    def __init__(self, command: list[str], cwd: Path, log: Path) -> None:
        self.command, self.cwd, self.log = command, cwd, log

    def start(self, threads: int) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        return subprocess.Popen(
            self.command, cwd=self.cwd, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT
        )


class PfllibSide(Side):
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


class PlflSide(Side):
    def __init__(self, config: Path, overrides: list[str], cfg: DictConfig, seeds: int, out: Path, column: str):
        self.cfg, self.out, self.seeds, self.column = cfg, out / "plfl", seeds, column
        plfl = str(Path(sys.executable).with_name("plfl"))
        fits = [
            shlex.join([plfl, "fit", "--config", str(config), *overrides, f"federation.seed={seed}"])
            + f" output_dir={shlex.quote(str(self.out))} name=seed{seed} progress_bar=false checkpoint_every=0"
            for seed in range(seeds)
            if self._run_dir(seed) is None
        ]
        super().__init__(["bash", "-ec", "\n".join(fits)], ROOT, out / "plfl.log")

    def accuracies(self) -> Optional[list[dict[int, float]]]:
        """Per seed, round → accuracy (%); None unless each seed has a completed run of this config."""
        runs = [self._run_dir(seed) for seed in range(self.seeds)]
        if None in runs:
            return None
        return [{r: 100 * v for r, v in zip(*read_report_run(run).series(self.column))} for run in runs]

    def _run_dir(self, seed: int) -> Optional[Path]:
        """The newest completed run of ``seed`` with this config's data, model, method and federation (a key that
        a run's config.yaml lacks, one added to plfl after it, counts as its default)."""
        sections = ("data", "model", "method", "federation")
        wanted = {s: OmegaConf.to_container(self.cfg[s]) for s in sections}
        wanted["federation"]["seed"] = seed
        wanted["federation"].pop("threads", None)  # each run records the thread count it chose
        for summary in sorted((self.out / f"seed{seed}").glob("*/summary.json"), reverse=True):
            config = load_config(summary.parent / "config.yaml")
            saved = {s: OmegaConf.to_container(config[s]) for s in sections}
            saved["federation"].pop("threads", None)
            if saved == wanted and read_report_run(summary.parent).status == "completed":
                return summary.parent
        return None


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


def summarize(seeds: list[dict[int, float]]) -> dict[int, tuple[float, float]]:
    """Round → (mean, sample std; 0 for one seed) over the seeds that evaluated the round."""
    rounds = sorted(set.intersection(*(set(s) for s in seeds)))
    return {
        r: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
        for r in rounds
        for v in [[s[r] for s in seeds]]
    }


def compare(plfl: list[dict[int, float]], pfllib: list[dict[int, float]], from_round: int) -> tuple[list[list], float]:
    """Rows (round, plfl mean, std, PFLlib mean, std, gap in pp) and the largest |gap| from ``from_round`` on.

    Raises:
        PlflError: the two sides evaluated no round in common from ``from_round`` on.
    """
    a, b = summarize(plfl), summarize(pfllib)
    rows = [[r, *a[r], *b[r], a[r][0] - b[r][0]] for r in sorted(a.keys() & b.keys())]
    checked = [abs(row[-1]) for row in rows if row[0] >= from_round]
    if not checked:
        raise PlflError(f"plfl evaluated rounds {sorted(a)} and PFLlib {sorted(b)}: none in common from {from_round}.")
    return rows, max(checked)


def run(args: argparse.Namespace) -> int:
    pairing = METHODS[args.method]
    config = ROOT / "configs" / f"{args.method}.yaml"
    overrides = [
        f"data.root={args.data.resolve()}",
        "data.source=pfllib",
        f"federation.rounds={args.rounds}",
        *pairing.overrides,
        *args.overrides,
    ]
    cfg = load_config(config, overrides)
    if cfg.model.name != "cnn":
        raise PlflError(f"model.name={cfg.model.name}: PFLlib's side is its CNN, so plfl's must be cnn.")
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
    _run_missing(sides)
    plfl, pfllib = (side.accuracies() for side in sides)
    rows, largest = compare(plfl, pfllib, args.from_round)
    _print(args, rows, largest, out)
    return 1 if largest > args.tolerance else 0


def _run_missing(sides: list[Side]) -> None:
    missing = [side for side in sides if side.accuracies() is None]
    threads = max(1, default_threads() // max(1, len(missing)))  # the idle CPUs this process may use
    for side in missing:
        print(f"running: {' '.join(side.command)}\n  (log: {side.log})", flush=True)
    running = [(side, side.start(threads)) for side in missing]
    while any(process.poll() is None for _, process in running):
        for side, process in running:
            # PFLlib trains once more after its last evaluation: stop it once every round is in.
            if isinstance(side, PfllibSide) and process.poll() is None and side.accuracies() is not None:
                process.terminate()
        time.sleep(1)
    for side, process in running:
        if side.accuracies() is None:
            tail = "".join(side.log.read_text(errors="replace").splitlines(keepends=True)[-15:])
            raise PlflError(f"{side.log} did not finish (exit status {process.returncode}); its end:\n{tail}")


def _print(args: argparse.Namespace, rows: list[list], largest: float, out: Path) -> None:
    def cell(mean: float, std: float) -> str:
        return f"{mean:.2f} ± {std:.2f}" if args.seeds > 1 else f"{mean:.2f}"

    pairing = METHODS[args.method]
    print(f"\n{args.method} ({pairing.algorithm} in PFLlib), {args.seeds} seed(s), data {args.data}\n")
    print(f"| round | plfl {pairing.column} (%) | PFLlib (%) | plfl − PFLlib (pp) |\n| --- | --- | --- | --- |")
    for r, a, sa, b, sb, gap in rows:
        print(f"| {r} | {cell(a, sa)} | {cell(b, sb)} | {gap:+.2f} |")
    with (out / "parity.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["round", "plfl", "plfl_std", "pfllib", "pfllib_std", "gap"])
        writer.writerows([[r, *(f"{v:.4f}" for v in rest)] for r, *rest in rows])
    print(f"\nlargest |gap| from round {args.from_round}: {largest:.2f} pp (tolerance {args.tolerance} pp)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pfllib", type=Path, help="root of a PFLlib checkout (it has system/main.py)")
    parser.add_argument("--method", choices=sorted(METHODS), help="plfl's method name (configs/NAME.yaml)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=1, help="plfl seeds 0..K-1; PFLlib --times K")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a federation in PFLlib's format")
    parser.add_argument("--dataset", default="MNIST", help="PFLlib's data set name (picks its CNN's input size)")
    parser.add_argument("--tolerance", type=float, default=1.0, help="percentage points (default 1.0)")
    parser.add_argument("--from-round", type=int, default=3, help="first round the tolerance applies to")
    parser.add_argument("--out", type=Path, help="where both sides' output goes (runs/pfllib-parity/NAME)")
    parser.add_argument("--mapping", action="store_true", help="print the flag table and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="plfl config overrides")
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
