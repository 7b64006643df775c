"""The progress display: the run directory when the run starts, a line per round with the run's ETA, and what
happens inside a round: in a log every heartbeat, on a terminal in a live display."""

import io
import re
import time

import pytest
from rich.console import Console

from plfl.activity import Activity
from plfl.callbacks import RoundProgress, RunStart
from plfl.experiment import run_experiment


def run_with_progress(digits_config, monkeypatch, terminal: bool, **keys) -> tuple[str, object]:
    """A 2-round digits run whose start and progress go to a string, its heartbeat every 20 ms; (output, run dir)."""
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=120, soft_wrap=True)
    monkeypatch.setattr("plfl.experiment.RoundProgress", lambda: RoundProgress(console, heartbeat_s=0.02))
    monkeypatch.setattr("plfl.experiment.RunStart", lambda: RunStart(console))
    run_dir, _ = run_experiment(
        digits_config(**{"progress_bar": True, "federation.rounds": 2, "federation.local_epochs": 20, **keys})
    )
    return out.getvalue(), run_dir


def test_a_log_gets_the_run_directory_a_line_per_round_and_a_heartbeat_inside_rounds(digits_config, monkeypatch):
    text, run_dir = run_with_progress(digits_config, monkeypatch, terminal=False)
    lines = text.splitlines()
    assert lines[0] == f"Run directory: {run_dir} (torch threads: 1)"
    rounds = [line for line in lines if re.match(r"round +\d/2  accuracy", line)]
    assert len(rounds) == 3 and rounds[0].endswith("ETA -:--:--")  # no training round measured yet
    assert re.search(r"train loss [\d.]+  [\d.]+ s  ETA 0:00:0\d$", rounds[1])
    beats = [line for line in lines if re.match(r"round \d: ", line)]
    training = [line for line in beats if line.startswith("round 1: training")]
    assert training, beats  # inside round 1's local training: clients done of 5, steps taken
    assert re.match(r"round 1: training, [0-5]/5 clients, [\d,]+ steps, \d+ s; ETA round \S+, run \S+$", training[-1])


def test_a_terminal_gets_a_live_display_above_which_the_round_lines_stay(digits_config, monkeypatch):
    raw, run_dir = run_with_progress(digits_config, monkeypatch, terminal=True)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)  # without the terminal's colours and cursor moves
    assert raw != text and f"Run directory: {run_dir}" in text
    assert len(re.findall(r"round +\d/2  accuracy", text)) == 3
    assert "fedavg-digits rounds" in text and re.search(r"round \d: \w+.*steps", text)  # the live display's lines


def test_without_a_progress_display_the_run_directory_comes_before_the_first_round(digits_config, monkeypatch):
    text, run_dir = run_with_progress(digits_config, monkeypatch, terminal=False, progress_bar=False)
    assert text == f"Run directory: {run_dir} (torch threads: 1)\n"  # and no round lines: no display


def test_the_inside_of_a_round_says_phase_work_clients_steps_and_etas_from_measured_rounds(monkeypatch):
    a = Activity()
    monkeypatch.setattr("plfl.callbacks.progress.activity", a)  # what the display reads
    progress = RoundProgress(Console(file=io.StringIO()))
    progress.rounds, progress.durations = 10, [30.0, 40.0, 50.0, 20.0]  # the last three: 110 s / 3
    a.start_round(4)
    a.start_phase("broadcast")
    a.start_work("ALA", 20)
    a.finish_clients(7)
    a.add_steps(1234)
    a.round_started = time.monotonic() - 10.0
    expected_round = 110 / 3 - 10  # 26.7 s
    expected_run = expected_round + 6 * 110 / 3  # rounds 5-10
    text = progress.inside_round()
    match = re.fullmatch(r"round 4: broadcast ALA, 7/20 clients, 1,234 steps, 10 s; ETA round (\S+), run (\S+)", text)
    assert match, text
    seconds = [sum(int(p) * 60**i for i, p in enumerate(reversed(g.split(":")))) for g in match.groups()]
    assert seconds == pytest.approx([expected_round, expected_run], abs=1)


def test_before_a_measured_round_the_first_training_round_estimates_from_its_clients(monkeypatch):
    a = Activity()
    monkeypatch.setattr("plfl.callbacks.progress.activity", a)
    progress = RoundProgress(Console(file=io.StringIO()))
    progress.rounds, progress.durations = 3, []
    a.start_round(1)
    a.start_phase("training")
    a.start_work("training", 4)
    assert progress.per_round(elapsed=5.0) is None  # no client done: no estimate
    a.finish_clients()
    assert progress.per_round(elapsed=5.0) == 20.0  # 5 s for one client of four
