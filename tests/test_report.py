"""plfl report: the HTML page of real runs, its panels, its errors, and its rendering in headless Chromium,
also of 20 runs laid out as a sweep (copies of a real run, see copy_as_sweep).

``render_in_chromium(html, png)`` is usable on its own to look at any report:

    PYTHONPATH=.:tests python -c "from pathlib import Path; from test_report import render_in_chromium; \
print(render_in_chromium(Path('report.html'), Path('report.png')))"
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import pytest
from omegaconf import OmegaConf
from plotly.offline import get_plotlyjs

from plfl.cli import main
from plfl.config import validate
from plfl.errors import PlflError
from plfl.methods.selffl import SelfFL
from plfl.report import load_runs, write_report
from plfl.report.figures import accuracy_figure, all_figures, communication_figure, panels_figure, seconds_figure
from plfl.report.runs import ReportRun, label_runs, read_csv

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
TITLES = [
    "Test accuracy per round",
    "Client accuracy at the best round",
    "Worst-10 %, top-10 % and largest-10 % client accuracy",
    "Test loss (solid) and training loss (dotted) per round",
    "Seconds per round",
    "Bytes sent and received by the server per round",
    "Global-model accuracy (solid) and personalized accuracy (dotted)",
    "ALA weight statistics",
    "Self-FL: variances and local steps",
    "PartialFed: probability of loading each layer from the global model",
]


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    """Four tiny real runs on digits (5 clients, MLP): FedALA and pFedLA for 2 rounds, Self-FL for 3
    (one warm-up round, so that σ_m² and l_m exist), PartialFed-Adaptive for 2 (one warm-up round)."""
    from plfl.experiment import run_experiment

    root = tmp_path_factory.mktemp("runs")
    base = {
        "output_dir": str(root),
        "progress_bar": False,
        "data": {"source": "digits", "num_clients": 5, "beta": 0.5},
        "model": {"name": "mlp", "hidden_sizes": [16]},
        "federation": {"rounds": 2, "lr": 0.05, "batch_size": 20},
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "disabled")
        for name, overrides in {
            "fedala": [],
            "pfedla": [],
            "selffl": ["federation.rounds=3", "method.warmup_rounds=1"],
            "partialfed": ["method.strategy=adaptive", "method.warmup_rounds=1"],
        }.items():
            dotlist = [f"name={name}", f"method.name={name}", *overrides]
            run_experiment(validate(OmegaConf.merge(base, OmegaConf.from_dotlist(dotlist))))
    return root


def run_dir(root: Path, name: str) -> Path:
    (path,) = (root / name).iterdir()
    return path


S_VALUES, SEEDS = (5, 10, 20, 40, 80), (0, 1, 2, 3)


SHORT, LONG = 10, 19  # the trials cut to one round and extended to 20 rounds


def copy_as_sweep(source: Path, root: Path) -> list[Path]:
    """20 finished runs laid out as ``plfl sweep`` leaves them (one name, a time folder per trial): copies
    of the real run ``source`` with method.s and federation.seed set per trial in config.yaml, and its
    metrics.csv changed per trial: accuracies raised by 2 points per trial, seconds and bytes scaled by
    10^-2 .. 10^2 (four orders of magnitude, where linear axes would flatten the fast runs onto zero).
    Trial SHORT is cut to one round, trial LONG extended to 20 by repeating its last round."""
    from plfl.callbacks.files import csv_text

    dirs = []
    for i, (s, seed) in enumerate((s, seed) for s in S_VALUES for seed in SEEDS):
        target = root / "fedala-s" / f"20260101-0000{i:02d}"
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("checkpoints"))
        cfg = OmegaConf.load(target / "config.yaml")
        cfg.name, cfg.method.s, cfg.federation.seed = "fedala-s", s, seed
        OmegaConf.save(cfg, target / "config.yaml")
        shift, scale = 0.02 * i, 10.0 ** (4 * i / 19 - 2)
        rows = read_csv(target / "metrics.csv")
        for row in rows:
            for column in ("accuracy", "worst10_accuracy", "largest10_accuracy", "best_accuracy"):
                row[column] = min(1.0, row[column] + shift)
            for column in ("seconds", "bytes_sent", "bytes_received"):
                if row[column] is not None:
                    row[column] *= scale
        clients = read_csv(target / "clients.csv")
        for row in clients:
            row["accuracy"] = min(1.0, row["accuracy"] + shift)
        if i in (SHORT, LONG):
            last = rows[-1]["round"]
            keep = range(2) if i == SHORT else range(21)
            rows = [{**rows[min(r, last)], "round": r} for r in keep]
            clients = [{**c, "round": r} for r in keep for c in clients if c["round"] == min(r, last)]
        (target / "metrics.csv").write_text(csv_text(rows))
        (target / "clients.csv").write_text(csv_text(clients))
        summary = json.loads((target / "summary.json").read_text())
        for key in ("best_accuracy", "final_accuracy"):
            summary[key] = min(1.0, summary[key] + shift)
        if i in (SHORT, LONG):
            summary["rounds"] = summary["final_round"] = rows[-1]["round"]
            summary["best_round"] = min(summary["best_round"], rows[-1]["round"])
        for key in ("seconds_per_round", "bytes_sent_per_round", "bytes_received_per_round"):
            summary[key] *= scale
        (target / "summary.json").write_text(json.dumps(summary))
        dirs.append(target)
    return dirs


@pytest.fixture(scope="module")
def sweep_root(runs_root, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    copy_as_sweep(run_dir(runs_root, "fedala"), root)
    return root


def test_page_holds_every_panel_and_no_network_reference(runs_root, tmp_path):
    out = write_report([runs_root], tmp_path / "report.html")
    page = out.read_text()
    assert page.count(get_plotlyjs()) == 1  # plotly.js inline, once
    own = page.replace(get_plotlyjs(), "")  # the page's own HTML and figure scripts
    assert not re.search(r"<script[^>]*\bsrc\s*=", own), "scripts must be inline, not loaded"
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", own)
    assert own.count("<script") == 1 + len(TITLES) + 1 + 1  # plotly.js, one per figure, the legend link
    for title in TITLES + ["Aggregation weights \u03b1 of pfedla, round 2"]:
        assert json.dumps(title)[1:-1] in page, title
    for details in (f"{m}, digits Dir(0.5), 5 clients, seed 0" for m in ("fedala", "pfedla", "selffl", "partialfed")):
        assert details in page  # in the hover texts


def test_figures_hold_the_runs_data(runs_root):
    runs = {r.method: r for r in load_runs([runs_root])}
    figures = {f.layout.title.text: f for f in all_figures(list(runs.values()))}
    assert set(TITLES) < set(figures) and len(figures) == len(TITLES) + 1  # one heatmap figure: pFedLA's

    metrics = read_csv(run_dir(runs_root, "fedala") / "metrics.csv")
    (line,) = [t for t in figures["Test accuracy per round"].data if t.name == "fedala"]
    assert list(line.y) == pytest.approx([100 * r["accuracy"] for r in metrics])

    # The box of each run holds its clients' accuracies at its best round, in %.
    clients = read_csv(run_dir(runs_root, "pfedla") / "clients.csv")
    best = runs["pfedla"].summary["best_round"]
    (box,) = [t for t in figures["Client accuracy at the best round"].data if t.legendgroup == "pfedla"]
    assert box.name == f"pfedla (round {best})" and box.orientation == "h"
    assert sorted(box.x) == pytest.approx(sorted(100 * r["accuracy"] for r in clients if r["round"] == best))

    # 5 clients: ⌈10 %⌉ is one client, so worst 10 % (left panel) is the minimum and top 10 % the maximum.
    # The third panel: metrics.csv's largest10_accuracy (one client of 5, the one with the most samples).
    tails = [t for t in figures[TITLES[2]].data if t.name == "pfedla"]
    worst, top, largest = tails
    assert (worst.xaxis, top.xaxis, largest.xaxis) == ("x", "x2", "x3") and list(worst.x) == list(top.x)
    for round_, low, high in zip(worst.x, worst.y, top.y):
        accuracies = [100 * r["accuracy"] for r in clients if r["round"] == round_]
        assert (low, high) == pytest.approx((min(accuracies), max(accuracies)))
    pfedla_metrics = read_csv(run_dir(runs_root, "pfedla") / "metrics.csv")
    assert list(largest.x) == [r["round"] for r in pfedla_metrics]
    assert list(largest.y) == pytest.approx([100 * r["largest10_accuracy"] for r in pfedla_metrics])
    for round_, value in zip(largest.x, largest.y):
        assert any(value == pytest.approx(100 * r["accuracy"]) for r in clients if r["round"] == round_)

    # Method-specific panels show only the runs that have the data.
    assert {t.name for t in figures["ALA weight statistics"].data} == {"fedala"}
    assert {t.legendgroup for t in figures["Self-FL: variances and local steps"].data} == {"selffl"}
    global_model, personalized = figures["Global-model accuracy (solid) and personalized accuracy (dotted)"].data
    assert (global_model.name, global_model.line.dash, global_model.showlegend) == ("selffl", "solid", True)
    assert (personalized.name, personalized.line.dash, personalized.showlegend) == ("selffl", "dot", False)
    steps = [t for t in figures["Self-FL: variances and local steps"].data if t.mode == "markers"]
    assert steps, "the clients' σ_m² and l_m from tables/selffl_clients.csv"

    # PartialFed-Adaptive's strategy: a line per layer with the table's probabilities.
    table = read_csv(run_dir(runs_root, "partialfed") / "tables" / "partialfed_strategy.csv")
    strategy = figures["PartialFed: probability of loading each layer from the global model"].data
    assert {t.legendgroup for t in strategy} == {"partialfed"} and len(strategy) == len({r["layer"] for r in table})
    assert sorted(y for t in strategy for y in t.y) == pytest.approx(sorted(r["global_probability"] for r in table))

    # pFedLA's Fig. 6: a client × client heatmap per layer; each client's weights over j sum to 1.
    (heatmaps,) = [f for title, f in figures.items() if title.startswith("Aggregation weights")]
    layers = {r["layer"] for r in read_csv(run_dir(runs_root, "pfedla") / "tables" / "aggregation_weights.csv")}
    assert len(heatmaps.data) == len(layers) >= 2
    for heatmap in heatmaps.data:
        assert len(heatmap.z) == 5 and all(len(row) == 5 for row in heatmap.z)
        assert all(math.isclose(sum(row), 1, rel_tol=1e-4) for row in heatmap.z)


def test_cli_writes_report_html_in_the_current_directory(runs_root, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(run_dir(runs_root, "fedala"))]) == 0
    assert capsys.readouterr().out == "Report: report.html\n"
    assert "Test accuracy per round" in (tmp_path / "report.html").read_text()


def test_bad_paths_are_clear_errors(runs_root, tmp_path, capsys):
    with pytest.raises(PlflError, match=f"{tmp_path / 'missing'} does not exist"):
        write_report([tmp_path / "missing"], tmp_path / "r.html")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PlflError, match="No run directories .* pass runs/<name>/<time>/"):
        write_report([tmp_path / "empty"], tmp_path / "r.html")
    partial = tmp_path / "partial"
    shutil.copytree(run_dir(runs_root, "fedala"), partial)
    (partial / "metrics.csv").unlink()
    with pytest.raises(PlflError, match=f"{partial} lacks metrics.csv: its files were moved or deleted"):
        write_report([partial], tmp_path / "r.html")
    assert main(["report", str(partial), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"plfl report: {partial} lacks metrics.csv") and "Traceback" not in err
    assert not (tmp_path / "r.html").exists()


def test_runs_written_before_largest10_accuracy_still_load_and_draw(runs_root, tmp_path):
    """A run whose metrics.csv lacks largest10_accuracy (plfl before it wrote the column) loads in the report
    and in plfl compare; the tail figure leaves that panel out, or leaves that run out of it beside a newer run."""
    from plfl.callbacks.files import csv_text
    from plfl.compare import comparison_table, read_run

    old = tmp_path / "old" / "fedala" / "20250101-000000"
    shutil.copytree(run_dir(runs_root, "fedala"), old)
    rows = [{k: v for k, v in r.items() if k != "largest10_accuracy"} for r in read_csv(old / "metrics.csv")]
    (old / "metrics.csv").write_text(csv_text(rows))
    (old_run,) = load_runs([tmp_path / "old"])
    assert not old_run.has("largest10_accuracy")
    figures = {f.layout.title.text: f for f in all_figures([old_run])}
    tails = figures["Worst-10 % and top-10 % client accuracy"]  # two panels, as before
    assert [a.text for a in tails.layout.annotations] == ["worst 10 % of clients", "top 10 % of clients"]
    assert [t.xaxis for t in tails.data] == ["x", "x2"]

    new_run = load_runs([run_dir(runs_root, "pfedla")])[0]
    label_runs([old_run, new_run])
    mixed = {f.layout.title.text: f for f in all_figures([old_run, new_run])}[TITLES[2]]
    assert [(t.name, t.xaxis) for t in mixed.data if t.xaxis == "x3"] == [("pfedla", "x3")]
    write_report([tmp_path / "old", run_dir(runs_root, "pfedla")], tmp_path / "report.html")
    assert "largest 10 % of clients (weighted)" in (tmp_path / "report.html").read_text()
    assert "(n=1)" in comparison_table([read_run(old)])


@dataclass
class Rendering:
    """What headless Chromium drew of a report page."""

    figures: int  # plotly figure containers on the page
    with_svg: int  # containers whose plot SVG exists
    drawn: int  # containers that drew every trace of their data (a .trace group or heatmap image each)
    severe: list[str]  # browser console messages of level SEVERE
    png: Path  # full-page screenshot
    then: Any = None  # what render_in_chromium's ``then`` returned


def render_in_chromium(
    html: Path, png: Path, width: int = 1400, then: Optional[Callable[[Any], Any]] = None
) -> Rendering:
    """Opens ``html`` in headless Chromium (Debian's chromium + chromium-driver; no display needed, no
    network: every host name fails to resolve), waits for the plots, saves a full-page screenshot, then
    calls ``then(driver)`` if given (to click, say), before reading the console."""
    from selenium import webdriver
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)  # with the driver's path below, selenium downloads nothing
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},1000",
        "--host-resolver-rules=MAP * ~NOTFOUND",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    count = """const plots = [...document.querySelectorAll('.plotly-graph-div')];
        return [plots.length, plots.filter(p => p.querySelector('.main-svg')).length,
                plots.filter(p => p.data && p.data.length > 0 &&
                     p.querySelectorAll('.trace').length + p.querySelectorAll('.hm image').length
                     === p.data.length).length];"""
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        driver.get(html.resolve().as_uri())
        try:
            WebDriverWait(driver, 60).until(lambda d: len(set(d.execute_script(count))) == 1)
        except TimeoutException:
            pass  # the counts below say what did not draw
        page_height = "return [document.documentElement.scrollHeight, window.outerHeight - window.innerHeight]"
        height = 0
        while height != (height := driver.execute_script(page_height)[0]):
            # The window is the page plus the browser's bars; plots redraw at the new size (height may change).
            driver.set_window_size(width, height + driver.execute_script(page_height)[1])
            driver.execute_async_script("requestAnimationFrame(() => requestAnimationFrame(arguments[0]))")
        figures, with_svg, drawn = driver.execute_script(count)
        driver.save_screenshot(str(png))
        after = then(driver) if then else None
        severe = [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    finally:
        driver.quit()
    return Rendering(figures, with_svg, drawn, severe, png, after)


def require_chromium() -> None:
    """Skips without Chromium, its driver or selenium; in CI (env CI set) fails instead."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if not missing:
        return
    message = (
        f"browser test needs {', '.join(missing)} (apt-get install chromium chromium-driver; pip install -e '.[dev]')"
    )
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.mark.slow
def test_report_renders_in_headless_chromium(runs_root, tmp_path, monkeypatch):
    require_chromium()
    from PIL import Image

    monkeypatch.delenv("DISPLAY", raising=False)
    html = write_report([runs_root], tmp_path / "report.html")
    result = render_in_chromium(html, tmp_path / "report.png")
    assert result.figures == len(TITLES) + 1
    assert result.with_svg == result.figures and result.drawn == result.figures
    assert result.severe == []

    image = Image.open(result.png).convert("RGB")
    assert image.height > 3000  # the whole page: nine figures of ~450 px
    pixels = np.asarray(image, dtype=int).reshape(-1, 3)
    coloured = pixels[pixels.max(axis=1) - pixels.min(axis=1) > 60]  # plot colours, not text or grid greys
    assert len(coloured) > 0.01 * len(pixels)
    assert len(np.unique(coloured // 32, axis=0)) >= 8


SWEEP_LABELS = [f"fedala-s: s={s}, seed={seed}" for s in S_VALUES for seed in SEEDS]


def bare_run(path: str, name: str, config: dict, status: str = "completed") -> ReportRun:
    return ReportRun(Path(path), name, "fedavg", "digits", 0, {"status": status}, [], [], config=config)


def test_labels_are_names_and_what_tells_same_named_runs_apart():
    lr = {"method.lr": 0.1, "federation.lr": 0.01}
    runs = [
        bare_run("runs/a/t0", "a", {"x": 1}),
        bare_run("runs/b/t0", "b", {"x": 1}),
        bare_run("runs/c/t0", "c", {"x": 1}),
        bare_run("runs/c/t1", "c", {"x": 1}, "failed"),  # run again
        bare_run("runs/d/t0", "d", lr),
        bare_run("runs/d/t1", "d", {"method.lr": 0.2, "federation.lr": 0.02}),
        bare_run("runs/e/t0", "e", dict.fromkeys("pqrs", 0)),
        bare_run("runs/e/t1", "e", dict.fromkeys("pqrs", 1)),
    ]
    label_runs(runs)
    assert [r.label for r in runs] == [
        "a",
        "b",
        "c: t0",
        "c: t1 [failed]",
        "d: method.lr=0.1, federation.lr=0.01",
        "d: method.lr=0.2, federation.lr=0.02",  # both end in "lr"
        "e: t0",
        "e: t1",
    ]  # four keys differ: over most_keys=3


def test_sweep_runs_have_short_legend_entries_and_details_on_hover(sweep_root):
    runs = load_runs([sweep_root])
    assert [r.label for r in runs] == SWEEP_LABELS  # method.s and federation.seed by their last parts
    for fig in all_figures(runs):
        groups = {}
        for trace in fig.data:
            run = runs[SWEEP_LABELS.index(trace.legendgroup)]
            assert trace.name.startswith(run.label) and len(trace.name) <= len(run.label) + len(" (round 2)")
            assert f"fedala, digits Dir(0.5), 5 clients, seed {run.seed}<br>{run.run_dir}" in trace.hovertemplate
            groups.setdefault(trace.legendgroup, set()).add(trace.line.color)
        assert all(len(colours) == 1 for colours in groups.values())  # a run's colour within the figure
        if fig.layout.showlegend is not False:  # one legend entry per run, in the table's order
            assert [t.name for t in fig.data if t.showlegend is not False] == SWEEP_LABELS
    accuracy, box = all_figures(runs)[:2]
    assert [t.line.color for t in accuracy.data] == [t.marker.color for t in box.data]  # across figures


def test_seconds_and_bytes_are_on_log_axes_with_sent_and_received_apart(sweep_root):
    runs = load_runs([sweep_root])
    fast, slow = runs[0], runs[-1]
    seconds = seconds_figure(runs)
    assert seconds.layout.yaxis.type == "log"
    lines = {t.name: t for t in seconds.data}
    assert list(lines[fast.label].y) == pytest.approx([r["seconds"] for r in fast.metrics])
    assert lines[slow.label].y[1] / lines[fast.label].y[1] == pytest.approx(1e4)  # copy_as_sweep's spread

    traffic = communication_figure(runs)
    assert traffic.layout.yaxis.type == traffic.layout.yaxis2.type == "log"
    assert [a.text for a in traffic.layout.annotations] == ["sent to clients", "received from clients"]
    sent, received = [t for t in traffic.data if t.legendgroup == fast.label]
    assert (sent.xaxis, received.xaxis) == ("x", "x2") and (sent.showlegend, received.showlegend) == (True, False)
    assert list(sent.y) == pytest.approx([r["bytes_sent"] for r in fast.metrics])
    assert list(received.x) == [1, 2]  # round 0 only broadcasts: nothing received
    assert list(received.y) == pytest.approx([r["bytes_received"] for r in fast.metrics[1:]])


def lab(colour: str) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of an sRGB hex colour."""
    linear = [
        (c / 255 + 0.055) ** 2.4 / 1.055**2.4 if c / 255 > 0.04045 else c / 255 / 12.92
        for c in bytes.fromhex(colour[1:])
    ]
    r, g, b = linear
    x, y, z = (
        (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047,
        0.2126 * r + 0.7152 * g + 0.0722 * b,
        (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883,
    )

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def test_report_takes_a_sweep_directory_and_finds_its_trials(sweep_root, tmp_path, monkeypatch):
    # trials.json as plfl sweep writes it, run directories recorded relative to where the sweep ran.
    trials = [
        {"trial": i + 1, "run_dir": f"runs/fedala-s/{d.name}"}
        for i, d in enumerate(sorted(sweep_root.glob("fedala-s/*")))
    ]
    sweep_dir = sweep_root / "sweeps" / "fedala_s"
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "trials.json").write_text(json.dumps({"trials": trials}))
    monkeypatch.chdir(tmp_path)  # not where the sweep ran: the trials are found beside the sweeps folder
    assert [r.label for r in load_runs([sweep_dir])] == SWEEP_LABELS


def test_twenty_runs_get_twenty_colours_that_stay_apart(sweep_root):
    runs = load_runs([sweep_root])
    colours = [t.line.color for t in accuracy_figure(runs).data]
    assert len(set(colours)) == 20
    closest = min(math.dist(lab(a), lab(b)) for a, b in itertools.combinations(colours, 2))
    assert closest > 20, closest  # CIE76 ΔE; plotly's default palette followed by Dark24 had pairs at 9
    assert max(lab(c)[0] for c in colours) <= 78  # none too light to read on the white page


def test_short_and_long_runs_share_a_round_axis_with_room_at_both_ends(sweep_root):
    runs = load_runs([sweep_root])
    figure = accuracy_figure(runs)
    assert list(figure.layout.xaxis.range) == [-0.5, 20.5]
    short, long = runs[SHORT], runs[LONG]
    assert [list(t.x) for t in figure.data if t.name in (short.label, long.label)] == [[0, 1], list(range(21))]


def test_values_within_ten_times_get_a_linear_axis_and_wider_spans_a_log_axis():
    fast, slow = bare_run("runs/a/t0", "a", {}), bare_run("runs/b/t0", "b", {})
    fast.metrics = [{"round": r, "seconds": 2.0 + r, "bytes_sent": 3e7, "bytes_received": 3.5e7} for r in range(3)]
    slow.metrics = [{"round": r, "seconds": 3000.0, "bytes_sent": 4e7, "bytes_received": 4e7} for r in range(3)]
    label_runs([fast, slow])
    assert seconds_figure([fast]).layout.yaxis.type == "linear"  # 2-4 s: plotly's log axis labels every digit
    wide = seconds_figure([fast, slow]).layout.yaxis
    assert (wide.type, wide.dtick) == ("log", 1)  # three decades and more: a label per decade
    traffic = communication_figure([fast, slow]).layout
    assert traffic.yaxis.type == traffic.yaxis2.type == "linear" and traffic.yaxis.tickformat == "~s"


def test_a_panel_whose_data_no_run_has_yet_is_left_out():
    young = bare_run("runs/selffl/t0", "selffl", {})  # before Self-FL's steps and client variances exist
    young.metrics = [{"round": r, "selffl_sigma0_sq": 0.1 * (r + 1)} for r in range(2)]
    label_runs([young])
    (plot,) = SelfFL.figures
    figure = panels_figure([young], plot)
    assert [a.text for a in figure.layout.annotations] == ["σ₀² (inter-client variance)"]


def test_zero_bytes_are_left_out_of_the_log_axis():
    local = bare_run("runs/local/t0", "local", {})
    local.metrics = [
        {"round": 0, "seconds": 0.5, "bytes_sent": 0, "bytes_received": None},
        {"round": 1, "seconds": 2.0, "bytes_sent": 0, "bytes_received": 0},
        {"round": 2, "seconds": 1.5, "bytes_sent": 400, "bytes_received": 0},
    ]
    label_runs([local])
    sent, received = communication_figure([local]).data
    assert (list(sent.x), list(sent.y)) == ([2], [400])
    assert list(received.x) == []
    assert list(seconds_figure([local]).data[0].y) == [0.5, 2.0, 1.5]


FIGURE_STATE = """return [...document.querySelectorAll('.plotly-graph-div')].map(p => ({
    title: p.layout.title.text,
    yaxes: Object.keys(p._fullLayout).filter(k => /^yaxis[0-9]*$/.test(k)).sort().map(k => p._fullLayout[k].type),
    legend: [...p.querySelectorAll('.legend .traces')].map(e => e.textContent),
    scrolls: Number(p.querySelector('.legend .scrollbar')?.getAttribute('height') || 0) > 0,
    hidden: [...new Set(p.data.filter(t => t.visible === 'legendonly').map(t => t.legendgroup))],
    xrange: p._fullLayout.xaxis.range}))"""


@pytest.mark.slow
def test_twenty_run_report_renders_readably_in_headless_chromium(sweep_root, tmp_path, monkeypatch):
    require_chromium()
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def click_a_run_in_the_first_legend(driver):
        before = driver.execute_script(FIGURE_STATE)
        driver.find_elements(By.CSS_SELECTOR, "#figure-0 .legend .traces .legendtoggle")[7].click()
        try:  # plotly waits out a possible double-click before it acts on a click
            WebDriverWait(driver, 10).until(lambda d: all(f["hidden"] for f in d.execute_script(FIGURE_STATE)))
        except TimeoutException:
            pass  # the assertion below says which figures did not follow
        return before, driver.execute_script(FIGURE_STATE)

    monkeypatch.delenv("DISPLAY", raising=False)
    html = write_report([sweep_root], tmp_path / "report.html")
    result = render_in_chromium(html, tmp_path / "report.png", then=click_a_run_in_the_first_legend)
    assert result.figures == result.with_svg == result.drawn == 7  # TITLES[:6] and ALA's
    assert result.severe == []

    before, after = result.then
    assert [f["title"] for f in before] == TITLES[:6] + ["ALA weight statistics"]
    assert [f["yaxes"] for f in before[:6]] == [
        ["linear"],
        ["category"],
        ["linear", "linear", "linear"],
        ["linear"],
        ["log"],
        ["log", "log"],
    ]
    for figure in before:
        assert figure["legend"] == ([] if figure["title"] == TITLES[1] else SWEEP_LABELS), figure["title"]
        assert not figure["scrolls"] and figure["hidden"] == [], figure["title"]  # every entry in view
    # One click in the first legend hides that run in every figure, the boxes included.
    assert [f["hidden"] for f in after] == [[SWEEP_LABELS[7]]] * 7
    # Rounds 0-20 with half a round of room at both ends: the one-round run is not drawn onto the axis.
    assert all(f["xrange"] == [-0.5, 20.5] for f in before if f["title"] != TITLES[1])


def test_runs_on_two_data_sets_get_an_accuracy_axis_each(digits_config):
    from plfl.experiment import run_experiment

    dirs = [
        run_experiment(digits_config(name=f"n{n}", **{"data.num_clients": n, "federation.rounds": 1}))[0]
        for n in (4, 5)
    ]
    runs = load_runs(dirs)
    figure = accuracy_figure(runs)
    assert [a.text for a in figure.layout.annotations] == ["digits Dir(0.5), 4 clients", "digits Dir(0.5), 5 clients"]
    assert [trace.yaxis for trace in figure.data] == ["y", "y2"]
