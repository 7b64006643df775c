"""A real Flower deployment on loopback (plfl.flower.loopback): a SuperLink with TLS and SuperNode authentication and
three SuperNodes, each its own process reading only its own clients' files. A plfl app run on them gives the
sequential executor's metrics; a node whose key is not registered is refused; a node killed mid-round leaves its
clients out under the failure policy and the run goes on."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("flwr")

from omegaconf import OmegaConf  # noqa: E402
from test_flower import assert_same_metrics, metrics  # noqa: E402

from plfl.config import load_config  # noqa: E402
from plfl.data import load_federated_data  # noqa: E402
from plfl.experiment import run_experiment  # noqa: E402
from plfl.flower.app import write_app  # noqa: E402
from plfl.flower.loopback import LoopbackDeployment  # noqa: E402
from plfl.flower.node_data import write_node_data  # noqa: E402


def run_dir_of(root, name):
    (run_dir,) = (root / name).iterdir()
    return run_dir


@pytest.mark.slow
def test_a_loopback_deployment_runs_refuses_an_unregistered_node_and_survives_a_killed_one(tmp_path):
    config = tmp_path / "digits.yaml"
    config.write_text(
        "data: {source: digits, num_clients: 6, beta: 0.5}\nmodel: {name: mlp, hidden_sizes: [32]}\n"
        "federation: {rounds: 2, lr: 0.05, batch_size: 20, threads: 1}\nprogress_bar: false\n"
    )
    runs = tmp_path / "runs"
    cfg = load_config(config, [f"output_dir={runs}", "name=sequential"])
    sequential_dir, _ = run_experiment(cfg)
    nodes = write_node_data(load_federated_data(OmegaConf.to_object(cfg).data, 0), 3, tmp_path / "data")
    app = tmp_path / "app"
    write_app(app, config, 3, timeout=60, overrides=[f"output_dir={runs}", "name=deployed"])
    with LoopbackDeployment(tmp_path / "deployment", keys=4) as deployment:
        for k in range(3):
            deployment.start_node(k, {"data-dir": str(nodes[k]), "state-dir": str(tmp_path / f"state-{k}")})
        done = deployment.run(app, timeout=900)
        assert "Successfully started run" in done.stdout, done.stdout + done.stderr
        deployed = run_dir_of(runs, "deployed")
        assert json.loads((deployed / "summary.json").read_text())["status"] == "completed"
        assert_same_metrics(deployed, sequential_dir)

        stranger = deployment.start_node(3, {"data-dir": str(nodes[0])}, registered=False)
        assert stranger.wait(timeout=120) != 0
        assert "Failed to activate SuperNode" in (tmp_path / "deployment" / "node-3.log").read_text()

        overrides = f"output_dir={runs} name=killed federation.rounds=1"
        run = threading.Thread(target=deployment.run, args=(app, f"overrides='{overrides}'", 900))
        run.start()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not (
            any((runs / "killed").glob("*/metrics.csv")) and len(metrics(run_dir_of(runs, "killed"))) >= 1
        ):
            time.sleep(0.5)
        deployment.kill("node-2")  # round 0 is evaluated: round 1 starts on clients 2 and 5 too
        run.join()
    killed = run_dir_of(runs, "killed")
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 1
    assert {(f["round"], f["client"]) for f in summary["client_failures"]} == {(1, 2), (1, 5)}
    assert all(f["reason"].startswith("SuperNode ") for f in summary["client_failures"])
    last = metrics(killed)[-1]
    assert (last["failed_clients"], last["unreachable_clients"]) == ("2", "2")
