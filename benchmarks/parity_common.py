"""What the parity scripts (``pfllib_parity.py``, ``flbench_parity.py``) share: plfl's side, the runs of both sides,
the per-round table with its gaps, and the command-line arguments they have in common.

Each script pairs a plfl method with the same method in another code base, maps plfl's resolved config onto that
code base's flags (:class:`Flag`), and compares plfl's accuracy after round r with the other side's (in %): the
mean and sample std over seeds, the gap plfl − other in percentage points, the largest |gap| from a round on.
"""

from __future__ import annotations

import argparse
import csv
import os
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
    """The other side's setting ``name`` from plfl's config ``key`` (through ``convert``, for keys counted
    differently)."""

    name: str
    key: str
    convert: Callable[[object, DictConfig], object] = lambda value, cfg: value
    note: str = ""


def flag_values(flags: tuple[Flag, ...], cfg: DictConfig) -> dict[str, str]:
    """Each flag's value for plfl's resolved ``cfg``, as text, in order (a later flag of the same name wins)."""
    return {flag.name: str(flag.convert(OmegaConf.select(cfg, flag.key), cfg)) for flag in flags}


class Side:
    """One side's command, its output in the comparison's folder, and its per-seed accuracies."""

    stop_when_complete = False  # True: the side keeps working after its last evaluation and is stopped there

    def __init__(self, command: list[str], cwd: Path, log: Path) -> None:
        self.command, self.cwd, self.log = command, cwd, log

    def start(self, threads: int) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        return subprocess.Popen(
            self.command, cwd=self.cwd, env=env, stdout=self.log.open("w"), stderr=subprocess.STDOUT
        )

    def accuracies(self) -> Optional[list[dict[int, float]]]:
        """Per seed, round → accuracy (%); None unless every seed's run is complete."""
        raise NotImplementedError


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


def plfl_config(args: argparse.Namespace, pairing_overrides: tuple[str, ...]) -> tuple[Path, list[str], DictConfig]:
    """plfl's config file, its overrides (the federation in ``--data``, ``--rounds``, the pairing's, the user's)
    and the resolved config.

    Raises:
        PlflError: the config's model is not plfl's ``cnn`` (the other sides' CNN is the same network).
    """
    config = ROOT / "configs" / f"{args.method}.yaml"
    overrides = [
        f"data.root={args.data.resolve()}",
        "data.source=pfllib",
        f"federation.rounds={args.rounds}",
        *pairing_overrides,
        *args.overrides,
    ]
    cfg = load_config(config, overrides)
    if cfg.model.name != "cnn":
        raise PlflError(f"model.name={cfg.model.name}: the other side runs FedAvg's CNN, so plfl's must be cnn.")
    return config, overrides, cfg


def summarize(seeds: list[dict[int, float]]) -> dict[int, tuple[float, float]]:
    """Round → (mean, sample std; 0 for one seed) over the seeds that evaluated the round."""
    rounds = sorted(set.intersection(*(set(s) for s in seeds)))
    return {
        r: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
        for r in rounds
        for v in [[s[r] for s in seeds]]
    }


def compare(plfl: list[dict[int, float]], other: list[dict[int, float]], from_round: int) -> tuple[list[list], float]:
    """Rows (round, plfl mean, std, other mean, std, gap in pp) and the largest |gap| from ``from_round`` on.

    Raises:
        PlflError: the two sides evaluated no round in common from ``from_round`` on.
    """
    a, b = summarize(plfl), summarize(other)
    rows = [[r, *a[r], *b[r], a[r][0] - b[r][0]] for r in sorted(a.keys() & b.keys())]
    checked = [abs(row[-1]) for row in rows if row[0] >= from_round]
    if not checked:
        raise PlflError(
            f"plfl evaluated rounds {sorted(a)} and the other side {sorted(b)}: none in common from {from_round}."
        )
    return rows, max(checked)


def run_missing(sides: list[Side]) -> None:
    """Run the sides whose output is incomplete, at once, each with an equal share of the idle CPUs this process
    may use; a side with ``stop_when_complete`` is stopped once its last round is in.

    Raises:
        PlflError: a side ended without a complete output (the message ends with its log's last lines).
    """
    missing = [side for side in sides if side.accuracies() is None]
    threads = max(1, default_threads() // max(1, len(missing)))  # the idle CPUs this process may use
    for side in missing:
        print(f"running: {' '.join(side.command)}\n  (log: {side.log})", flush=True)
    running = [(side, side.start(threads)) for side in missing]
    while any(process.poll() is None for _, process in running):
        for side, process in running:
            if side.stop_when_complete and process.poll() is None and side.accuracies() is not None:
                process.terminate()
        time.sleep(1)
    for side, process in running:
        if side.accuracies() is None:
            tail = "".join(side.log.read_text(errors="replace").splitlines(keepends=True)[-15:])
            raise PlflError(f"{side.log} did not finish (exit status {process.returncode}); its end:\n{tail}")


def print_table(
    args: argparse.Namespace, heading: str, column: str, other: str, rows: list[list], largest: float, out: Path
) -> None:
    """Print ``heading`` and the Markdown table (``other``: the other side's name), write ``out/parity.csv`` (its
    columns ``<other>`` and ``<other>_std`` in lower case) and print the largest |gap|."""

    def cell(mean: float, std: float) -> str:
        return f"{mean:.2f} ± {std:.2f}" if args.seeds > 1 else f"{mean:.2f}"

    print(f"\n{heading}, {args.seeds} seed(s), data {args.data}\n")
    print(f"| round | plfl {column} (%) | {other} (%) | plfl − {other} (pp) |\n| --- | --- | --- | --- |")
    for r, a, sa, b, sb, gap in rows:
        print(f"| {r} | {cell(a, sa)} | {cell(b, sb)} | {gap:+.2f} |")
    name = other.lower().replace("-", "")
    with (out / "parity.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["round", "plfl", "plfl_std", name, f"{name}_std", "gap"])
        writer.writerows([[r, *(f"{v:.4f}" for v in rest)] for r, *rest in rows])
    print(f"\nlargest |gap| from round {args.from_round}: {largest:.2f} pp (tolerance {args.tolerance} pp)")


def add_arguments(parser: argparse.ArgumentParser, methods: list[str], other: str, default_out: str) -> None:
    """The arguments both scripts take: ``--method``, ``--rounds``, ``--seeds``, ``--data``, ``--tolerance``,
    ``--from-round``, ``--out``, ``--mapping`` and plfl's ``key=value`` overrides."""
    parser.add_argument("--method", choices=methods, help="plfl's method name (configs/NAME.yaml)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=1, help=f"plfl seeds 0..K-1; {other} the same K seeds")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a federation in PFLlib's format")
    parser.add_argument("--tolerance", type=float, default=1.0, help="percentage points (default 1.0)")
    parser.add_argument("--from-round", type=int, default=3, help="first round the tolerance applies to")
    parser.add_argument("--out", type=Path, help=f"where both sides' output goes ({default_out}/NAME)")
    parser.add_argument("--mapping", action="store_true", help="print the flag table and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="plfl config overrides")
