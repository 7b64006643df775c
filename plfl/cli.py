"""Command line: ``plfl fit --config X.yaml [key=value ...]``."""

from __future__ import annotations

import argparse
import sys
import traceback

from omegaconf import OmegaConf

from plfl.errors import PlflError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plfl", description="Personalized federated learning experiments.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit", help="run a federation described by a YAML config")
    fit.add_argument("--config", "-c", help="YAML config file (see configs/)")
    fit.add_argument("overrides", nargs="*", metavar="key=value", help="dot-list overrides, e.g. federation.rounds=5")
    fit.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    fit.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of a failure")
    return parser


def fit(args: argparse.Namespace) -> None:
    from plfl.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(OmegaConf.to_yaml(cfg), end="")
        return
    from plfl.experiment import run_experiment  # imports torch and Lightning: only when training

    run_dir, summary = run_experiment(cfg)
    best, final = summary["best_accuracy"], summary["final_accuracy"]
    print(f"Best accuracy {100 * best:.2f} % (round {summary['best_round']}), final {100 * final:.2f} %, "
          f"{summary['seconds_per_round']:.2f} s per round")
    print(f"Run directory: {run_dir}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``plfl`` script; returns the exit status.

    Exit status: 0 success, 2 bad input (config, data), 1 any other failure,
    130 interrupted. Failures print one paragraph to stderr; ``--debug`` adds the traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        fit(args)
    except PlflError as e:
        return _fail(args, f"plfl {args.command}: {e}", 2)
    except KeyboardInterrupt:
        return _fail(args, f"plfl {args.command}: interrupted; rounds finished so far are in the run directory.", 130)
    except Exception as e:  # noqa: BLE001  anything else still gets one readable paragraph
        return _fail(args, f"plfl {args.command} failed: {type(e).__name__}: {e}. "
                           "Re-run with --debug to see the traceback.", 1)
    return 0


def _fail(args: argparse.Namespace, message: str, status: int) -> int:
    if args.debug:
        traceback.print_exc()
    print(message, file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
