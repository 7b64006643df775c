"""How long ``plfl fit`` takes to refuse a bad config, against importing torch and Lightning.

Each case is a fresh process running ``plfl fit --config configs/quickstart.yaml KEY=VALUE`` until it exits with
the config error (status 2); the reference is ``python -c "import torch, lightning"``. Every case runs ``--runs``
times, interleaved with the reference, and the script prints each one's median seconds, the ratio of its median
to the reference's, and whether the process imported torch.

    python benchmarks/config_error_time.py [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "import torch, lightning"
# A config error of each kind: (what, override). A method's key names are read from its module's source; the
# values of its keys are checked last, against the module, which imports torch.
CASES = [
    ("unknown key", "federation.roundz=3"),
    ("value out of range", "federation.lr=-1"),
    ("a data key the source does not read", "data.cache_dir=/tmp"),
    ("a model key the model does not read", "model.name=cnn"),
    ("unknown method", "method.name=fedrox"),
    ("unknown executor", "federation.executor=spark"),
    ("a method key the method does not have", "method.sx=40"),
    ("a method value out of range", "method.s=0"),
]
RUN = (
    "import sys; from plfl.cli import main; status = main(['fit', '--config', 'configs/quickstart.yaml', {!r}]); "
    "print('torch' in sys.modules, file=sys.stderr); sys.exit(status)"
)


def seconds(code: str) -> tuple[float, str]:
    """Wall-clock seconds of a fresh ``python -c code`` in the repository, and its last stderr line."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - start, (out.stderr.strip().splitlines() or [""])[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="processes per case (default 7)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"import torch, lightning": []}
    torch_loaded: dict[str, str] = {}
    for _ in range(args.runs):
        times["import torch, lightning"].append(seconds(REFERENCE)[0])
        for what, override in CASES:
            elapsed, last = seconds(RUN.format(override))
            times.setdefault(what, []).append(elapsed)
            torch_loaded[what] = last
    reference = statistics.median(times["import torch, lightning"])
    print(f"| case | median s ({args.runs} runs) | ratio to import torch, lightning | imports torch |")
    print("| --- | --- | --- | --- |")
    for what, values in times.items():
        loaded = torch_loaded.get(what, "True")
        print(f"| {what} | {statistics.median(values):.2f} | {statistics.median(values) / reference:.2f} | {loaded} |")


if __name__ == "__main__":
    main()
