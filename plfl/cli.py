"""Command line: ``plfl fit --config X.yaml [--seeds 0,1,2] [key=value ...]``, ``plfl fit --resume RUN_DIR``,
``plfl sweep X.yaml [--count N] [--parallel N] [key=value ...]``, ``plfl compare RUN_DIR...``,
``plfl reproduce SUITE [--cells PATTERN] [--rounds N] [--seeds K] [--parallel N] [key=value ...]``,
``plfl reproduce --list``, ``plfl report RUN_DIR... [-o report.html]``, ``plfl invert --config X.yaml --client C
--round R [--batch-size B] [--attack dlg|idlg] [--iterations N] [--restarts K] [key=value ...]``,
``plfl methods [NAME]``, ``plfl flower run --config X.yaml [--nodes N] [key=value ...]``, ``plfl flower run --resume
RUN_DIR --nodes N``,
``plfl flower split --config X.yaml --nodes N --output DIR [key=value ...]``, ``plfl flower app --config X.yaml
--nodes N --output DIR [--timeout S] [key=value ...]``,
``plfl --version``.

Only what a command needs is imported: Lightning, W&B and the data readers only when training, so that config
errors, ``--print-config`` and ``plfl methods`` answer before them (the methods' modules, which a config is
checked against, import torch). ``fit``, ``sweep`` and ``reproduce`` stop on SIGINT and SIGTERM
(:mod:`plfl.stopping`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import traceback
from importlib import metadata
from pathlib import Path

from omegaconf import OmegaConf

import plfl
from plfl.compare import comparison_table, find_runs, read_run
from plfl.errors import FederationError, PlflError
from plfl.stopping import Stopped, stop_on_signals

EXAMPLE_CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # in a clone of the repository


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plfl", description="Personalized federated learning experiments.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    parser.add_argument("--version", action="version", version=version_text())
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit", help="run a federation described by a YAML config")
    fit.add_argument("--config", "-c", help="YAML config file (see configs/)")
    fit.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest intact checkpoint (its config.yaml, "
        "plus any key=value overrides, e.g. federation.rounds=50)",
    )
    fit.add_argument("overrides", nargs="*", metavar="key=value", help="dot-list overrides, e.g. federation.rounds=5")
    fit.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    fit.add_argument(
        "--seeds",
        type=seed_list,
        metavar="S1,S2,...",
        help="repeat the run once per seed (federation.seed) and report mean ± std of the best accuracy",
    )
    fit.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a failure")
    sweep = commands.add_parser("sweep", help="run a W&B sweep file offline, one trial after another or N at once")
    sweep.add_argument("sweep_file", help="W&B sweep YAML whose command runs plfl fit (see sweeps/)")
    sweep.add_argument("overrides", nargs="*", metavar="key=value", help="dot-list overrides for every trial")
    sweep.add_argument(
        "--count",
        type=int,
        metavar="N",
        help="stop once the sweep holds N trials, earlier runs' included "
        "(default: the file's run_cap; a grid ends by itself)",
    )
    sweep.add_argument("--retry-failed", action="store_true", help="run the trials that failed before again")
    sweep.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="run up to N trials at once, each as a Ray task on one CPU (needs Ray: "
        "pip install -e '.[ray]'; default 1: one after another in this process)",
    )
    sweep.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a failure"
    )
    compare = commands.add_parser("compare", help="print a method × data set table of finished runs")
    compare.add_argument(
        "runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories, or folders holding them (e.g. runs/)"
    )
    compare.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a failure"
    )
    report = commands.add_parser("report", help="write an interactive HTML page of finished runs (opens offline)")
    report.add_argument(
        "runs", nargs="+", type=Path, metavar="RUN_DIR", help="run directories, or folders holding them (e.g. runs/)"
    )
    report.add_argument(
        "--output", "-o", type=Path, default=Path("report.html"), help="HTML file to write (default: report.html)"
    )
    report.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a failure"
    )
    reproduce = commands.add_parser(
        "reproduce", help="run a paper's table (a suite) and print plfl's values beside the paper's"
    )
    reproduce.add_argument("suite", nargs="?", help="suite YAML, or the name of one in suites/ (plfl reproduce --list)")
    reproduce.add_argument("overrides", nargs="*", metavar="key=value", help="dot-list overrides for every run")
    reproduce.add_argument("--list", action="store_true", help="list the repository's suites and exit")
    reproduce.add_argument(
        "--no-run", action="store_true", help="run nothing: the table of the runs there are (e.g. still running)"
    )
    reproduce.add_argument(
        "--cells", metavar="PATTERN", help="only cells whose SETTING/METHOD matches, e.g. 'cifar10-*/*'"
    )
    reproduce.add_argument(
        "--rounds", type=int, metavar="N", help="rounds per run (default the paper's; fewer mark the table scaled)"
    )
    reproduce.add_argument("--seeds", type=int, metavar="K", help="the first K seeds per cell (default the suite's)")
    reproduce.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="run up to N runs at once, each as a Ray task on one CPU (needs Ray, as plfl sweep --parallel)",
    )
    reproduce.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a failure"
    )
    invert = commands.add_parser(
        "invert", help="reconstruct a client's training batch from its upload of one round (DLG, iDLG)"
    )
    invert.add_argument("--config", "-c", required=True, help="YAML config file (see configs/)")
    invert.add_argument("overrides", nargs="*", metavar="key=value", help="dot-list overrides, e.g. method=fedavg")
    invert.add_argument("--client", type=int, default=0, metavar="C", help="the attacked client's id (default 0)")
    invert.add_argument(
        "--round", type=int, default=1, metavar="R", help="the round whose upload is attacked, 1.. (default 1)"
    )
    invert.add_argument(
        "--batch-size",
        type=int,
        metavar="B",
        help="federation.batch_size: the batch to reconstruct (default: the config's)",
    )
    invert.add_argument("--attack", choices=("dlg", "idlg"), default="dlg", help="DLG, or iDLG for B = 1 (default dlg)")
    invert.add_argument(
        "--iterations", type=int, default=300, metavar="N", help="L-BFGS iterations of each draw (default 300)"
    )
    invert.add_argument(
        "--restarts", type=int, default=4, metavar="K", help="random draws, the best match kept (default 4)"
    )
    invert.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a failure"
    )
    flower = commands.add_parser("flower", help="a config as a Flower app: in Flower's simulation runtime, or split")
    actions = flower.add_subparsers(dest="action", required=True)
    run = actions.add_parser(
        "run", help="run a config in Flower's simulation runtime (needs Flower: pip install -e '.[flower]')"
    )
    split = actions.add_parser("split", help="write each SuperNode's own clients' data files (data-dir=node-K)")
    app = actions.add_parser("app", help="write a Flower app of a config for flwr run on a SuperLink and SuperNodes")
    run.add_argument("--config", "-c", help="YAML config file (see configs/)")
    run.add_argument(
        "--resume", type=Path, metavar="RUN_DIR", help="continue a plfl flower run from its newest checkpoint"
    )
    for action in (split, app):
        action.add_argument("--config", "-c", required=True, help="YAML config file (see configs/)")
    for action in (run, split, app):
        action.add_argument("overrides", nargs="*", metavar="key=value", help="dot-list overrides, e.g. method=fedala")
        action.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a failure"
        )
    run.add_argument(
        "--nodes", type=int, default=2, metavar="N", help="SuperNodes; node K holds clients K, K + N, ... (default 2)"
    )
    split.add_argument("--nodes", type=int, required=True, metavar="N", help="SuperNodes; node K gets K, K + N, ...")
    split.add_argument("--output", "-o", type=Path, required=True, metavar="DIR", help="writes DIR/node-K/ for each")
    app.add_argument("--nodes", type=int, required=True, metavar="N", help="the SuperNodes the server waits for")
    app.add_argument("--output", "-o", type=Path, required=True, metavar="DIR", help="writes DIR/pyproject.toml")
    app.add_argument(
        "--timeout", type=float, metavar="S", help="seconds to wait for the nodes' replies (default: until all answer)"
    )
    methods = commands.add_parser("methods", help="list the methods (method.name) with their keys and defaults")
    methods.add_argument("names", nargs="*", metavar="NAME", help="only these methods (default: all)")
    methods.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a failure"
    )
    return parser


def version_text() -> str:
    """``plfl X.Y.Z (Python a.b.c, torch ..., torchvision ..., lightning ...)``, read from package metadata (no
    torch import)."""
    return (
        f"plfl {plfl.__version__} (Python {platform.python_version()}, torch {installed('torch')}, "
        f"torchvision {installed('torchvision')}, lightning {installed('lightning')})"
    )


def installed(package: str) -> str:
    """``package``'s installed version, or "not installed"."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def seed_list(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 0,1,2") from None


def fit(args: argparse.Namespace) -> None:
    from plfl.config import load_config, resume_config

    if args.resume and (args.config or args.seeds):
        raise PlflError("--resume continues one run with its own config.yaml; drop --config and --seeds.")
    if not args.resume and not args.config:
        raise PlflError(f"plfl fit needs --config FILE (or --resume RUN_DIR). {example_configs()}")
    if args.resume:
        cfg = resume_config(args.resume, args.overrides)
    else:
        cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(OmegaConf.to_yaml(cfg), end="")
        return
    check_torch_builds()
    from plfl.experiment import run_experiment  # imports torch and Lightning: only when training

    run_dirs = []
    for seed in args.seeds or [cfg.federation.seed]:
        cfg.federation.seed = seed
        run_dir, summary = run_experiment(cfg, args.resume)
        print_summary(run_dir, summary)
        run_dirs.append(run_dir)
    if args.seeds:
        print(f"Seeds {args.seeds}: best accuracy mean ± std over seeds")
        print(comparison_table([read_run(d) for d in run_dirs]))


def flower(args: argparse.Namespace) -> None:
    from plfl.config import load_config, resume_config

    if args.action == "run" and bool(args.config) == bool(args.resume):
        raise PlflError("plfl flower run needs --config FILE or --resume RUN_DIR (one of them).")
    resume = args.resume if args.action == "run" else None
    cfg = resume_config(resume, args.overrides) if resume else load_config(args.config, args.overrides)
    if args.action == "app":
        from plfl.flower.app import check_flower, write_app

        check_flower(cfg)
        path = write_app(args.output, Path(args.config), args.nodes, args.timeout, args.overrides)
        print(f"{path}: run it with flwr run {args.output} CONNECTION --stream")
        return
    check_torch_builds()
    if args.action == "split":
        from plfl.data import load_federated_data
        from plfl.flower.node_data import write_node_data

        config = OmegaConf.to_object(cfg)
        data = load_federated_data(config.data, config.federation.seed)
        if not 1 <= args.nodes <= len(data.clients):
            raise PlflError(f"--nodes {args.nodes}: each node holds one of the {len(data.clients)} clients at least")
        for directory in write_node_data(data, args.nodes, args.output):
            print(f'{directory}: start its SuperNode with --node-config "data-dir={directory.resolve()}"')
        return
    try:
        from plfl.flower.app import run_simulation
    except ImportError as missing:
        raise PlflError(f"plfl flower needs Flower ({missing}): pip install -e '.[flower]'") from None
    outcome = run_simulation(cfg, args.nodes, {"client_resources": {"num_cpus": 1}}, resume)
    print_summary(outcome["run_dir"], outcome["summary"])


def print_summary(run_dir: Path, summary: dict) -> None:
    """A finished run's headline figures, its disk use and its directory."""
    best, final = summary["best_accuracy"], summary["final_accuracy"]
    headline = "Best accuracy"
    if summary.get("selected_accuracy") is not None:  # data.val_fraction: the round chosen on validation
        headline = (
            f"Accuracy selected on validation {100 * summary['selected_accuracy']:.2f} % "
            f"(round {summary['selected_round']}); best on test"
        )
    print(
        f"{headline} {100 * best:.2f} % (round {summary['best_round']}), final {100 * final:.2f} %, "
        f"{summary['seconds_per_round']:.2f} s per round"
    )
    if summary.get("final_unseen_accuracy") is not None:  # federation.unseen_clients
        print(
            f"Unseen clients ({summary['num_unseen_clients']}) at the final round "
            f"{100 * summary['final_unseen_accuracy']:.2f} %, participation gap "
            f"{100 * summary['final_participation_gap']:+.2f} points"
        )
    if summary.get("simulated_seconds_per_round") is not None:  # federation.system
        print(
            f"Simulated {summary['simulated_seconds_per_round']:.2f} s per round; client-rounds dropped out "
            f"{summary['dropped_clients']}, late {summary['late_clients']}, cut to partial work "
            f"{summary['partial_clients']}"
        )
    print(disk_use_line(run_dir))
    print(f"Run directory: {run_dir}")


def disk_use(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def disk_use_line(run_dir: Path) -> str:
    """What the run directory holds on disk, its checkpoints' share, and the keys that set how many are kept."""
    checkpoints = run_dir / "checkpoints"
    kept = disk_use(checkpoints) if checkpoints.is_dir() else 0
    return (
        f"Disk use: {disk_use(run_dir) / 1e6:,.1f} MB, checkpoints {kept / 1e6:,.1f} MB of it (keep_checkpoints=N "
        "keeps the newest N; null, the default, keeps the last one once a run completes; checkpoint_every=0 "
        "writes none)"
    )


def check_torch_builds() -> None:
    """torchvision must be the build made for the installed torch (torch 2.N pairs with torchvision 0.(N+15));
    a mismatched pair imports with "operator torchvision::nms does not exist", or fails later.

    Raises:
        PlflError: torchvision does not load, or its version is not torch's pair; the message names both
            versions and the install command.
    """
    torch_version, vision_version = installed("torch"), installed("torchvision")
    major, minor = (int(part) for part in torch_version.split(".")[:2])
    expected = f"0.{minor + 15}" if major == 2 else None
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # noqa: BLE001  a mismatched C++ extension raises RuntimeError, OSError, ...
        problem = f"torchvision {vision_version} does not load beside torch {torch_version} ({error})"
    else:
        if expected is None or vision_version.startswith(f"{expected}."):
            return
        problem = f"torchvision {vision_version} is not the build for torch {torch_version}"
    pair = f"torchvision=={expected}.*" if expected else "the torchvision built for it"
    raise PlflError(
        f"{problem}. Install {pair} from the index torch came from (pytorch.org's selector; for the CPU build "
        "--index-url https://download.pytorch.org/whl/cpu), or reinstall both together: pip install torch "
        "torchvision."
    )


def example_configs() -> str:
    """A sentence naming the example configs of the repository, when plfl runs from a clone."""
    names = sorted(p.name for p in EXAMPLE_CONFIGS.glob("*.yaml"))
    if not names:
        return "Example configs are in the configs/ folder of plfl's repository."
    return (
        f"Start with plfl fit --config {EXAMPLE_CONFIGS / 'quickstart.yaml'} (FedALA on scikit-learn's "
        f"bundled digits, no files needed); the examples in {EXAMPLE_CONFIGS}: {', '.join(names)}."
    )


def methods(args: argparse.Namespace) -> None:
    """Print each method's summary and its ``method.*`` keys: default, allowed values, meaning."""
    from plfl.fields import key_rows
    from plfl.methods import method_class, methods, summary

    classes = {name: method_class(name) for name in args.names or methods()}  # unknown names fail first
    for name, cls in classes.items():
        print(f"{name}: {summary(cls)}")
        for row in key_rows(cls.config_class, "method."):
            if row.key != "method.name":
                allowed = f" ({row.allowed})" if row.allowed else ""
                print(f"  {row.key} = {row.default}{allowed}" + (f": {row.doc}" if row.doc else ""))
        print()


def invert(args: argparse.Namespace) -> None:
    """Run the config's federation to ``--round``, reconstruct ``--client``'s batch from its upload and print the
    per-image PSNR, SSIM and labels (:func:`plfl.inversion.invert`)."""
    from plfl.config import load_config

    overrides = list(args.overrides)
    if args.batch_size is not None:
        overrides.append(f"federation.batch_size={args.batch_size}")
    if args.iterations < 1 or args.restarts < 1:
        raise PlflError(
            f"--iterations {args.iterations} --restarts {args.restarts}: the attack needs at least one draw and one "
            "L-BFGS iteration; pass numbers >= 1."
        )
    cfg = load_config(args.config, overrides)
    check_torch_builds()
    from plfl.inversion import invert, table  # imports torch and Lightning: only when attacking

    run_dir, report = invert(cfg, args.client, args.round, args.attack, args.iterations, args.restarts)
    print(
        f"{args.attack.upper()} on client {args.client}'s upload of round {args.round} (B = {report['batch_size']}, "
        f"{args.iterations} iterations × {args.restarts} draws, privacy.level={report['privacy']}):"
    )
    print(table(report))
    print(f"Run directory: {run_dir} (inversion.json, inversion.png)")


def compare(args: argparse.Namespace) -> None:
    print(comparison_table([read_run(d) for d in find_runs(args.runs)]))


def report(args: argparse.Namespace) -> None:
    from plfl.report import write_report  # imports plotly: only when reporting

    print(f"Report: {write_report(args.runs, args.output)}")


def sweep(args: argparse.Namespace) -> int:
    """Returns 1 when a trial in the sweep failed (its error is in the table), else 0."""
    from plfl.sweep import print_results, run_sweep

    check_torch_builds()

    # There is no sweep server: W&B runs of the trials stay offline unless WANDB_MODE says otherwise.
    os.environ.setdefault("WANDB_MODE", "offline")
    result = run_sweep(args.sweep_file, args.overrides, args.count, args.retry_failed, parallel=args.parallel)
    print_results(result)
    failed = sum(t["status"] == "failed" for t in result.trials)
    if failed:
        print(
            f"{failed} of {len(result.trials)} trials failed; the error column says why "
            "(--retry-failed runs them again).",
            file=sys.stderr,
        )
    return 1 if failed else 0


def reproduce(args: argparse.Namespace) -> int:
    """``--list``: the suites with their cells; else run the suite (``--no-run``: nothing) and print its table.
    Returns 1 when a run of a selected cell failed or is unfinished (the table lists it), else 0."""
    from plfl.reproduce import list_suites, load_suite, run_suite, suite_list_hint, suite_path, suite_text

    if args.list:
        for suite in list_suites():
            seeds = f"{suite.seeds} seed" + ("s" if suite.seeds > 1 else "")
            print(f"{suite.name}: {suite.title} ({len(suite.cells)} cells, {suite.rounds} rounds, {seeds})")
        return 0
    if not args.suite:
        raise PlflError(f"plfl reproduce needs a suite. {suite_list_hint()}")
    suite = load_suite(suite_path(args.suite))
    check_torch_builds()
    os.environ.setdefault("WANDB_MODE", "offline")  # as plfl sweep: no server to log many runs to
    suite_dir, results = run_suite(
        suite, args.overrides, args.cells, args.rounds, args.seeds, args.parallel, run=not args.no_run
    )
    print(suite_text(suite, results), end="")
    print(f"Suite directory: {suite_dir} (results.csv, results.md; plfl report {suite_dir} shows its runs)")
    return 1 if any(r.failed for r in results) else 0


COMMANDS = {
    "fit": fit,
    "sweep": sweep,
    "reproduce": reproduce,
    "compare": compare,
    "report": report,
    "invert": invert,
    "methods": methods,
    "flower": flower,
}
INTERRUPTED = {
    "fit": "rounds finished so far are in the run directory; plfl fit --resume RUN_DIR continues",
    "sweep": "finished trials are saved; run the same command again to continue, the stopped trials first",
    "reproduce": "finished runs are kept; run the same command again to continue the stopped ones",
    "compare": "nothing was written",
    "report": "the report may be incomplete; run the command again",
    "invert": "the run directory keeps its rounds; run the command again",
    "methods": "nothing was written",
    "flower": "the rounds finished so far are in the run directory",
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``plfl`` script; returns the exit status.

    Exit status: 0 success, 2 bad input (config, data), 1 a failed federation or any other failure,
    130 (SIGINT, Ctrl+C) or 143 (SIGTERM) when a signal stopped ``fit`` or ``sweep`` (:mod:`plfl.stopping`).
    Failures print one paragraph to stderr; ``--debug`` adds the traceback.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse fills every positional at its first one, so `sweep X.yaml --count 3 a=b` (or `fit a=b --seeds 1,2
    # c=d`) leaves the later overrides over.
    positional = args.command in ("fit", "sweep", "reproduce", "invert", "flower")
    if extra and positional and not any(e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        with stop_on_signals() if args.command in ("fit", "sweep", "reproduce") else contextlib.nullcontext():
            return COMMANDS[args.command](args) or 0
    except Stopped as stop:
        return _fail(args, stopped_message(args.command, stop), stop.exit_status)
    except FederationError as e:
        return _fail(args, f"plfl {args.command} failed: {e}", 1)
    except PlflError as e:
        return _fail(args, f"plfl {args.command}: {e}", 2)
    except KeyboardInterrupt:
        return _fail(args, f"plfl {args.command}: interrupted; {INTERRUPTED[args.command]}.", 130)
    except Exception as e:  # noqa: BLE001  anything else still gets one readable paragraph
        return _fail(
            args, f"plfl {args.command} failed: {type(e).__name__}: {e}. Re-run with --debug to see the traceback.", 1
        )


def stopped_message(command: str, stop: Stopped) -> str:
    """What a stopped ``fit`` kept and how to continue it; for ``sweep`` and ``reproduce``, where their runs are."""
    if command in ("sweep", "reproduce"):
        return f"Stopped by {stop.name}; {INTERRUPTED[command]}."
    if stop.round is None:
        return f"Stopped by {stop.name} before round 0 finished; nothing to continue."
    from plfl.checkpoint import NAME, list_checkpoints  # torch is loaded already: the run trained

    checkpoints = list_checkpoints(Path(stop.run_dir) / "checkpoints")
    if not checkpoints:
        return f"Stopped by {stop.name} after round {stop.round}; its results are in {stop.run_dir} (no checkpoint)."
    saved = int(NAME.fullmatch(checkpoints[0].name).group(1))
    restart = "" if saved == stop.round else f" (from the checkpoint of round {saved})"
    return f"Stopped by {stop.name} after round {stop.round}; continue with: plfl fit --resume {stop.run_dir}{restart}"


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    if args.debug:
        traceback.print_exc()
    print(message, file=sys.stderr)
    return status
