"""plfl report: the HTML page of real runs, its panels, its errors, and its rendering in headless Chromium.

``render_in_chromium(html, png)`` is usable on its own to look at any report:

    PYTHONPATH=.:tests python -c "from pathlib import Path; from test_report import render_in_chromium; \
print(render_in_chromium(Path('report.html'), Path('report.png')))"
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf
from plotly.offline import get_plotlyjs

from plfl.cli import main
from plfl.config import validate
from plfl.errors import PlflError
from plfl.report import load_runs, write_report
from plfl.report.figures import all_figures
from plfl.report.runs import read_csv

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
TITLES = ["Test accuracy per round", "Client accuracy at the best round", "Worst-10 % and top-10 % client accuracy",
          "Seconds per round", "Bytes sent and received by the server per round", "Global-model accuracy",
          "ALA weight statistics", "Self-FL: variances and local steps"]


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    """Three tiny real runs on digits (5 clients, MLP): FedALA and pFedLA for 2 rounds, Self-FL for 3
    (one warm-up round, so that σ_m² and l_m exist)."""
    from plfl.experiment import run_experiment

    root = tmp_path_factory.mktemp("runs")
    base = {"output_dir": str(root), "progress_bar": False,
            "data": {"source": "digits", "num_clients": 5, "beta": 0.5},
            "model": {"name": "mlp", "hidden_sizes": [16]},
            "federation": {"rounds": 2, "lr": 0.05, "batch_size": 20}}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "disabled")
        for name, overrides in {"fedala": [], "pfedla": [],
                                "selffl": ["federation.rounds=3", "method.warmup_rounds=1"]}.items():
            dotlist = [f"name={name}", f"method.name={name}", *overrides]
            run_experiment(validate(OmegaConf.merge(base, OmegaConf.from_dotlist(dotlist))))
    return root


def run_dir(root: Path, name: str) -> Path:
    (path,) = (root / name).iterdir()
    return path


def test_page_holds_every_panel_and_no_network_reference(runs_root, tmp_path):
    out = write_report([runs_root], tmp_path / "report.html")
    page = out.read_text()
    assert page.count(get_plotlyjs()) == 1  # plotly.js inline, once
    own = page.replace(get_plotlyjs(), "")  # the page's own HTML and figure scripts
    assert not re.search(r"<script[^>]*\bsrc\s*=", own), "scripts must be inline, not loaded"
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", own)
    assert own.count("<script") == 1 + len(TITLES) + 1  # plotly.js, then one per figure
    for title in TITLES + ["Aggregation weights \u03b1 of pfedla: pfedla, digits, seed 0, round 2"]:
        assert json.dumps(title)[1:-1] in page, title
    for label in ("fedala: fedala, digits, seed 0", "pfedla: pfedla, digits, seed 0",
                  "selffl: selffl, digits, seed 0"):
        assert label in page


def test_figures_hold_the_runs_data(runs_root):
    runs = {r.method: r for r in load_runs([runs_root])}
    figures = {f.layout.title.text: f for f in all_figures(list(runs.values()))}
    assert set(TITLES) < set(figures) and len(figures) == len(TITLES) + 1  # one heatmap figure: pFedLA's

    metrics = read_csv(run_dir(runs_root, "fedala") / "metrics.csv")
    (line,) = [t for t in figures["Test accuracy per round"].data if t.name.startswith("fedala:")]
    assert list(line.y) == pytest.approx([100 * r["accuracy"] for r in metrics])

    # The box of each run holds its clients' accuracies at its best round, in %.
    clients = read_csv(run_dir(runs_root, "pfedla") / "clients.csv")
    best = runs["pfedla"].summary["best_round"]
    (box,) = [t for t in figures["Client accuracy at the best round"].data if t.name.startswith("pfedla<br>")]
    assert f"round {best}" in box.name
    assert sorted(box.y) == pytest.approx(sorted(100 * r["accuracy"] for r in clients if r["round"] == best))

    # 5 clients: ⌈10 %⌉ is one client, so worst 10 % is the minimum and top 10 % the maximum.
    tails = {t.name: t for t in figures["Worst-10 % and top-10 % client accuracy"].data}
    for round_, worst, top in zip(tails["pfedla: pfedla, digits, seed 0: worst 10 %"].x,
                                  tails["pfedla: pfedla, digits, seed 0: worst 10 %"].y,
                                  tails["pfedla: pfedla, digits, seed 0: top 10 %"].y):
        accuracies = [100 * r["accuracy"] for r in clients if r["round"] == round_]
        assert (worst, top) == pytest.approx((min(accuracies), max(accuracies)))

    # Method-specific panels show only the runs that have the data.
    assert {t.name for t in figures["ALA weight statistics"].data} == {"fedala: fedala, digits, seed 0"}
    assert {t.legendgroup for t in figures["Self-FL: variances and local steps"].data} == {
        "selffl: selffl, digits, seed 0"}
    assert {t.name for t in figures["Global-model accuracy"].data} == {
        "selffl: selffl, digits, seed 0: global model", "selffl: selffl, digits, seed 0: personalized"}
    steps = [t for t in figures["Self-FL: variances and local steps"].data if t.mode == "markers"]
    assert steps, "the clients' σ_m² and l_m from tables/selffl_clients.csv"

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


@dataclass
class Rendering:
    """What headless Chromium drew of a report page."""

    figures: int  # plotly figure containers on the page
    with_svg: int  # containers whose plot SVG exists
    drawn: int  # containers that drew every trace of their data (a .trace group or heatmap image each)
    severe: list[str]  # browser console messages of level SEVERE
    png: Path  # full-page screenshot


def render_in_chromium(html: Path, png: Path, width: int = 1400) -> Rendering:
    """Opens ``html`` in headless Chromium (Debian's chromium + chromium-driver; no display needed, no
    network: every host name fails to resolve), waits for the plots and saves a full-page screenshot."""
    from selenium import webdriver
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)  # with the driver's path below, selenium downloads nothing
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={width},1000", "--host-resolver-rules=MAP * ~NOTFOUND"):
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
        driver.set_window_size(width, driver.execute_script("return document.documentElement.scrollHeight"))
        driver.execute_async_script("requestAnimationFrame(() => requestAnimationFrame(arguments[0]))")
        figures, with_svg, drawn = driver.execute_script(count)
        driver.save_screenshot(str(png))
        severe = [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    finally:
        driver.quit()
    return Rendering(figures, with_svg, drawn, severe, png)


def require_chromium() -> None:
    """Skips without Chromium, its driver or selenium; in CI (env CI set) fails instead."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.is_file()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    if not missing:
        return
    message = (f"browser test needs {', '.join(missing)} "
               "(apt-get install chromium chromium-driver; pip install -e '.[dev]')")
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(message)
    pytest.skip(message)


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
