"""Simulated client systems (``federation.system.*``): profiles drawn or read from a trace, dropout, a round
deadline with late clients dropped or cut to partial work, and the simulated time per round."""

import json

import pytest
from test_validation import csv_rows, summary_of

from plfl.config import resume_config
from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.sections import SystemConfig
from plfl.system import ClientProfile, SystemSimulation, client_profiles, read_trace
from plfl.tasks import EvalTask, TrainResult, TrainTask

SYSTEM = {
    "federation.system.sample_seconds": 0.001,
    "federation.system.compute_spread": 1.0,
    "federation.system.latency": 0.01,
    "federation.system.bandwidth": 1e6,
    "federation.system.network_spread": 0.5,
    "federation.system.deadline": 0.15,
}


def simulation(**keys) -> SystemSimulation:
    return SystemSimulation(SystemConfig(**keys), num_train=[30, 100], batch_size=10, seed=0)


def test_a_clients_round_takes_its_download_compute_and_upload():
    profile = ClientProfile(sample_seconds=0.01, latency=0.5, bandwidth=1000.0)
    sim = simulation(sample_seconds=1.0, deadline=10.0, late="partial")
    sim.profiles = [profile, profile]
    # (0.5 + 2000 / 1000) + 100 · 0.01 + (0.5 + 1000 / 1000)
    assert sim.arrival(0, down=2000, samples=100, up=1000) == pytest.approx(5.0)
    assert sim.budget(0, down=2000) == pytest.approx((10.0 - 2 * 2.5) / 0.01)  # 500 samples
    assert sim.late(10.01) and not sim.late(10.0)
    assert sim.round_seconds([3.0, 4.5], missing=False) == 4.5
    assert sim.round_seconds([3.0, 4.5], missing=True) == 10.0
    assert simulation(sample_seconds=1.0, deadline=10.0).budget(0, down=2000) is None  # late=drop: never cut


def test_profiles_are_drawn_from_the_seed_about_the_medians():
    alike = client_profiles(SystemConfig(sample_seconds=0.002, latency=0.1, bandwidth=500.0), 4, seed=0)
    assert alike == [ClientProfile(0.002, 0.1, 500.0)] * 4
    config = SystemConfig(sample_seconds=0.002, compute_spread=1.0, latency=0.1, bandwidth=500.0, network_spread=1.0)
    drawn = client_profiles(config, 200, seed=0)
    assert drawn == client_profiles(config, 200, seed=0) != client_profiles(config, 200, seed=1)
    median = sorted(p.sample_seconds for p in drawn)[100]
    assert 0.0015 < median < 0.0027  # log-normal about 0.002
    assert all(p.latency * p.bandwidth == pytest.approx(50.0) for p in drawn)  # a slow link is slow both ways


def test_a_trace_gives_every_client_its_profile(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,sample_seconds,latency,bandwidth\n1,0.5,0.25,\n0,0.01,0.1,2000\n")
    assert read_trace(trace, 2) == [ClientProfile(0.01, 0.1, 2000.0), ClientProfile(0.5, 0.25, None)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "Cannot read the system trace"),
        ("client,sample_seconds,latency\n0,1,1\n", "no column bandwidth"),
        ("client,sample_seconds,latency,bandwidth\n0,1,1,\n", "no row for client 1"),
        ("client,sample_seconds,latency,bandwidth\n0,1,1,\n0,1,1,\n", "client 0 is repeated"),
        ("client,sample_seconds,latency,bandwidth\n0,-1,1,\n1,1,1,\n", "line 2: times must be finite and >= 0"),
        ("client,sample_seconds,latency,bandwidth\n0,fast,1,\n", "not a number"),
    ],
)
def test_a_bad_trace_is_refused_with_the_line_and_the_fix(tmp_path, text, message):
    trace = tmp_path / "trace.csv"
    if text is not None:
        trace.write_text(text)
    with pytest.raises(ConfigError, match=message) as error:
        read_trace(trace, 2)
    assert "one row per client 0..1" in str(error.value)


def test_a_deadline_without_simulated_time_is_refused(digits_config, tmp_path):
    with pytest.raises(ConfigError, match="deadline=1.0 needs simulated times: set federation.system.sample_seconds"):
        run_experiment(digits_config(**{"federation.system.deadline": 1}))
    assert not list(tmp_path.iterdir())


def test_dropout_draws_each_round_and_client_with_its_probability():
    sim = simulation(dropout=0.3)
    draws = [sim.drops_out(client, round_) for round_ in range(1, 2001) for client in range(2)]
    assert 0.27 < sum(draws) / len(draws) < 0.33
    assert draws == [sim.drops_out(client, round_) for round_ in range(1, 2001) for client in range(2)]
    assert not any(simulation().drops_out(0, r) for r in range(100))


def work(tasks):
    """A client's round that yields ``tasks`` one by one and returns the results it received."""
    results = []
    for task in tasks:
        results.append((yield task))
    return results


def run(hook, samples_per_step=10):
    """Drive ``hook`` by hand: each training task 'processes' its steps × 10 samples; returns (value, tasks)."""
    seen, result = [], None
    while True:
        try:
            task = hook.send(result)
        except StopIteration as stop:
            return stop.value, seen
        seen.append(task)
        if isinstance(task, TrainTask):
            steps = task.steps if task.steps is not None else task.epochs * 3
            result = TrainResult({}, 0.0, steps * samples_per_step)
        else:
            result = "evaluated"


def test_partial_work_cuts_training_tasks_to_whole_batches_within_the_budget():
    sim = simulation()
    first = TrainTask(0, {}, seed=1, epochs=2)  # 2 epochs of 3 batches of client 0's 30 samples: 60 samples
    second = TrainTask(0, {}, seed=2, epochs=1)  # 30 samples
    evaluation = EvalTask(0, {})
    (value, processed, cut), seen = run(sim.metered(0, work([first, evaluation, second]), budget=None))
    assert (processed, cut) == (90, False) and seen == [first, evaluation, second]
    (value, processed, cut), seen = run(sim.metered(0, work([first, evaluation, second]), budget=75))
    assert seen[0] is first and seen[1] is evaluation and (seen[2].steps, seen[2].epochs) == (1, None)
    assert (processed, cut, len(value)) == (70, True, 3)
    (value, processed, cut), seen = run(sim.metered(0, work([first, second]), budget=65))
    assert value is None and (processed, cut) == (60, True) and len(seen) == 1  # no batch left for the second
    (value, _, _), seen = run(sim.metered(0, work([first]), budget=9.5))
    assert value is None and seen == []


def test_a_seeded_system_run_is_reproduced_and_counts_who_was_dropped_late_or_cut(digits_config):
    config = {**SYSTEM, "federation.system.dropout": 0.3, "federation.rounds": 4, "data.num_clients": 8}
    first, summary = run_experiment(digits_config(name="first", **config))
    second, _ = run_experiment(digits_config(name="second", **config))
    rows = csv_rows(first / "metrics.csv")
    assert rows == csv_rows(second / "metrics.csv") and summary_of(first) == summary_of(second)
    trained = rows[1:]
    assert sum(int(r["dropped_clients"]) for r in trained) == summary["dropped_clients"] > 0
    assert sum(int(r["late_clients"]) for r in trained) == summary["late_clients"] > 0
    model_bytes = int(rows[0]["bytes_sent"]) // 8  # every client receives the global model
    for r in trained:
        accepted = 8 - int(r["dropped_clients"]) - int(r["late_clients"])
        assert int(r["bytes_received"]) == accepted * model_bytes
        assert 0 < float(r["simulated_seconds"]) <= 0.15
    timeline = csv_rows(first / "tables" / "system_clients.csv")
    for r in trained:
        statuses = [t["status"] for t in timeline if t["round"] == r["round"]]
        assert len(statuses) == 8 and statuses.count("dropped") == int(r["dropped_clients"])
        assert statuses.count("late") == int(r["late_clients"]) and "partial" not in statuses
        arrivals = [float(t["arrival"]) for t in timeline if t["round"] == r["round"] and t["status"] == "full"]
        assert max(arrivals) <= 0.15 and float(r["simulated_seconds"]) == pytest.approx(0.15)
    assert all(float(t["arrival"]) > 0.15 for t in timeline if t["status"] == "late" and t["arrival"])
    assert summary["simulated_seconds_per_round"] == pytest.approx(
        sum(float(r["simulated_seconds"]) for r in trained) / 4
    )


def test_late_clients_send_partial_work_where_they_would_be_dropped(digits_config):
    config = {**SYSTEM, "federation.rounds": 2, "data.num_clients": 8}
    dropped, drop = run_experiment(digits_config(name="drop", **config))
    cut, partial = run_experiment(digits_config(name="partial", **config, **{"federation.system.late": "partial"}))
    assert drop["late_clients"] > partial["late_clients"] and partial["partial_clients"] > 0
    assert drop["partial_clients"] == 0
    assert partial["late_clients"] + partial["partial_clients"] >= drop["late_clients"]
    for r in csv_rows(cut / "metrics.csv")[1:]:
        assert float(r["simulated_seconds"]) <= 0.15


def test_a_round_whose_clients_all_drop_out_leaves_the_server_as_it_was(digits_config):
    run_dir, summary = run_experiment(digits_config(**{"federation.system.dropout": 0.99, "federation.rounds": 2}))
    rows = csv_rows(run_dir / "metrics.csv")
    assert [r["dropped_clients"] for r in rows[1:]] == ["5", "5"] and summary["status"] == "completed"
    assert rows[0]["accuracy"] == rows[1]["accuracy"] == rows[2]["accuracy"]
    assert "simulated_seconds" not in rows[1]


def test_a_run_with_stragglers_resumes_to_the_same_files(digits_config):
    config = digits_config(
        **{
            **SYSTEM,
            "federation.system.dropout": 0.3,
            "federation.system.late": "partial",
            "federation.rounds": 3,
            "data.num_clients": 8,
        }
    )
    config.keep_checkpoints = 3
    run_dir, _ = run_experiment(config)
    straight = summary_of(run_dir), csv_rows(run_dir / "metrics.csv"), csv_rows(run_dir / "clients.csv")
    (run_dir / "checkpoints" / "round-00003.pt").unlink()
    (run_dir / "summary.json").unlink()
    run_experiment(resume_config(run_dir), run_dir)
    assert (summary_of(run_dir), csv_rows(run_dir / "metrics.csv"), csv_rows(run_dir / "clients.csv")) == straight
    assert json.loads((run_dir / "summary.json").read_text())["partial_clients"] > 0


def test_partial_work_agrees_on_the_sequential_and_vectorized_executors(digits_config):
    config = {**SYSTEM, "federation.system.late": "partial", "federation.rounds": 2, "data.num_clients": 8}
    runs = {
        executor: csv_rows(
            run_experiment(digits_config(name=executor, **config, **{"federation.executor": executor}))[0]
            / "metrics.csv"
        )
        for executor in ("sequential", "vectorized")
    }
    for one, other in zip(runs["vectorized"], runs["sequential"], strict=True):
        for key in ("late_clients", "partial_clients", "simulated_seconds", "bytes_received"):
            assert one.get(key) == other.get(key)
        assert float(one["accuracy"]) == pytest.approx(float(other["accuracy"]), abs=1e-6)


def test_system_keys_out_of_range_are_refused(digits_config):
    with pytest.raises(ConfigError, match="federation.system.dropout"):
        digits_config(**{"federation.system.dropout": 1.0})
    with pytest.raises(ConfigError, match="federation.system.late"):
        digits_config(**{"federation.system.late": "wait"})
