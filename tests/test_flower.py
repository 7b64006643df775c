"""plfl as a Flower app: requests carry each model once, nodes hold their own clients, what only a simulation has
is refused, the server sees sample counts but no samples, and a run on SuperNodes (in this process, and in
Flower's simulation runtime) gives the sequential executor's metrics."""

from __future__ import annotations

import csv
import itertools

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("flwr")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from plfl.cli import main  # noqa: E402
from plfl.config import resume_config  # noqa: E402
from plfl.data import load_federated_data  # noqa: E402
from plfl.errors import ConfigError, DataError, PlflError  # noqa: E402
from plfl.experiment import run_experiment  # noqa: E402
from plfl.flower.app import check_flower, client_app, run_config, run_simulation  # noqa: E402
from plfl.flower.node import node_clients  # noqa: E402
from plfl.flower.node_data import ARRAYS, read_node_data, write_node_data  # noqa: E402
from plfl.flower.records import models_of, with_models  # noqa: E402
from plfl.flower.server import FlowerClients  # noqa: E402

# The five methods whose Flower runs are checked against the sequential executor: their client hooks keep state
# (FedALA's, Ditto's personal models, Self-FL's statistics) and their servers differ (pFedLA's hypernetworks).
METHODS = ("fedavg", "fedala", "ditto", "pfedla", "selffl")


class InProcessGrid:
    """A Flower Grid whose SuperNodes are ClientApps of ``cfg`` in this process, node K holding clients K, K +
    ``nodes``, ...; each node keeps its own context, as a SuperNode does, and each grid is a new Flower run."""

    runs = itertools.count(1)

    def __init__(self, cfg, nodes: int, data_dirs=None, state_root=None):
        self.app = client_app(state_root=state_root)  # the nodes' config comes from the server
        self.cfg, self.nodes, self.sent = cfg, nodes, []
        self.run_id = next(self.runs)
        self.contexts = {100 + k: self.context(100 + k, k, nodes) for k in range(nodes)}
        for k, directory in enumerate(data_dirs or []):
            self.contexts[100 + k] = Context(self.run_id, 100 + k, {"data-dir": str(directory)}, RecordDict(), {})

    def clients(self, num_nodes=None, **options) -> FlowerClients:
        """The server's side over these nodes, sending them the run's config."""
        return FlowerClients(self, num_nodes or self.nodes, config=self.cfg, **options)

    def context(self, node: int, partition: int, partitions: int) -> Context:
        return Context(self.run_id, node, {"partition-id": partition, "num-partitions": partitions}, RecordDict(), {})

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        for m in messages:  # as a Grid sends them: each message's id
            m.metadata.__dict__["_message_id"] = m.object_id
            self.sent.append(m.metadata.message_type)
        return [self.app(m, self.contexts[m.metadata.dst_node_id]) for m in messages]


@pytest.fixture
def flower_identity(monkeypatch):
    """The run identity Flower's messages are stamped with inside an app."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0)


def metrics(run_dir):
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def assert_same_metrics(flower_dir, sequential_dir):
    """Every metric of the Flower run equals the sequential run's (seconds apart); the method's statistics of its
    clients' state (e.g. FedALA's ala_weight_mean) stay on the nodes."""
    flower, sequential = metrics(flower_dir), metrics(sequential_dir)
    assert len(flower) == len(sequential)
    for ours, theirs in zip(flower, sequential):
        for key, value in ours.items():
            if key != "seconds":
                assert value == pytest.approx(theirs[key]) if value else value == theirs[key], key


def test_a_request_carries_each_model_once_and_the_node_reads_one_object_per_model(flower_identity):
    shared = {"w": torch.arange(6.0).reshape(2, 3)}
    own = {"w": torch.ones(2, 3)}
    records = with_models({"clients": [0, 1, 2, 3]}, [shared, None, own, shared])
    assert sorted(records.array_records) == ["model.0", "model.1"]
    received = models_of(records)
    assert received[1] is None and received[0] is received[3]
    assert torch.equal(received[0]["w"], shared["w"]) and torch.equal(received[2]["w"], own["w"])


def test_a_node_holds_every_num_partitions_th_client_from_its_partition_id():
    assert node_clients({"partition-id": 1, "num-partitions": 3}, 8) == [1, 4, 7]
    with pytest.raises(ConfigError, match="partition-id=K num-partitions=P"):
        node_clients({"partition-id": 0}, 8)
    with pytest.raises(ConfigError, match="outside 0..2"):
        node_clients({"partition-id": 3, "num-partitions": 3}, 8)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"attack.kind": "sign_flip", "attack.fraction": 0.2}, "attack.kind=sign_flip is simulated in one process"),
        ({"federation.unseen_clients": 2}, "federation.unseen_clients=2.0 is simulated"),
        ({"privacy.level": "sample"}, "privacy.level=sample accounts"),
        ({"federation.executor": "ray"}, "each SuperNode runs its own clients"),
    ],
)
def test_what_only_a_simulation_has_is_refused(digits_config, keys, message):
    with pytest.raises(ConfigError, match=message):
        check_flower(digits_config(**keys))


def test_the_server_sees_sample_counts_but_no_samples(digits_config, flower_identity):
    cfg = digits_config()
    data = InProcessGrid(cfg, 2).clients().federated_data()
    assert len(data.clients) == 5 and data.input_shape == (1, 8, 8) and data.num_classes == 10
    assert all(c.num_train > 0 and c.x_train.device.type == "meta" for c in data.clients)
    with pytest.raises(NotImplementedError):
        data.clients[0].y_train.tolist()


def test_nodes_that_hold_other_clients_than_0_to_n_are_refused(digits_config, flower_identity):
    grid = InProcessGrid(digits_config(), 2)
    grid.contexts[101] = grid.context(101, 0, 2)  # the clients of node 100
    with pytest.raises(PlflError, match="client 0 is on SuperNodes 100 and 101"):
        grid.clients()
    with pytest.raises(PlflError, match="2 of the 3 SuperNodes connected"):
        InProcessGrid(digits_config(), 2).clients(3, wait=0)


@pytest.mark.parametrize("method", ["fedavg", "fedala"])
def test_a_run_on_supernodes_gives_the_sequential_executors_metrics(digits_config, flower_identity, method):
    cfg = digits_config(**{"method.name": method, "federation.rounds": 2})
    sequential_dir, _ = run_experiment(cfg)
    grid = InProcessGrid(cfg, 2)
    flower_dir, summary = run_experiment(cfg, remote=grid.clients())
    assert summary["status"] == "completed"
    assert_same_metrics(flower_dir, sequential_dir)
    # Per node: one description, then a broadcast that carries the evaluation for rounds 0..2 and a training for 1..2
    assert sorted(grid.sent) == sorted(2 * ["query.describe", *3 * ["query.initialise"], *2 * ["train"]])


def test_a_broadcast_in_groups_carries_each_groups_evaluation(digits_config, flower_identity):
    """With federation.state_offload the loop broadcasts and evaluates in groups of a round's clients (2 of 5 here);
    every group's evaluation still comes with its broadcast."""
    cfg = digits_config(**{"federation.rounds": 2, "federation.join_ratio": 0.4, "federation.state_offload": True})
    sequential_dir, _ = run_experiment(cfg)
    grid = InProcessGrid(cfg, 2)
    flower_dir, _ = run_experiment(cfg, remote=grid.clients())
    assert_same_metrics(flower_dir, sequential_dir)
    assert "evaluate" not in grid.sent


def test_nodes_that_read_only_their_own_clients_files_give_the_sequential_executors_metrics(
    digits_config, flower_identity, tmp_path
):
    cfg = digits_config(**{"method.name": "ditto", "federation.rounds": 2})
    directories = write_node_data(load_federated_data(OmegaConf.to_object(cfg).data, 0), 2, tmp_path / "nodes")
    assert sorted(f.name for f in directories[1].iterdir()) == ["client-1.npz", "client-3.npz", "federation.json"]
    sequential_dir, _ = run_experiment(cfg)
    flower_dir, _ = run_experiment(cfg, remote=InProcessGrid(cfg, 2, directories).clients())
    assert_same_metrics(flower_dir, sequential_dir)


def test_a_nodes_corrupt_or_pickled_client_file_is_refused_naming_it(digits_config, tmp_path):
    cfg = digits_config()
    (node,) = write_node_data(load_federated_data(OmegaConf.to_object(cfg).data, 0), 1, tmp_path)
    np.savez(node / "client-2.npz", x_train=np.array([object()]))
    with pytest.raises(DataError, match="client-2.npz cannot be read as a client's data .*plfl flower split"):
        read_node_data(node)
    (node / "client-2.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="client-2.npz cannot be read"):
        read_node_data(node)
    np.savez(node / "client-2.npz", **{k: np.zeros((2, 3), np.float32) for k in ARRAYS})
    with pytest.raises(DataError, match=r"client-2.npz: x_train is torch.float32 \(2, 3\)"):
        read_node_data(node)


def test_a_run_on_supernodes_resumes_from_the_servers_checkpoint_and_the_nodes_state(
    digits_config, flower_identity, tmp_path
):
    """Stopped after round 2 (the server's checkpoint, each node's state of round 2), resumed on fresh node
    processes that read their state directories, a run ends as an uninterrupted one does."""
    cfg = digits_config(**{"method.name": "fedala", "federation.rounds": 4})
    sequential_dir, _ = run_experiment(cfg)
    two = digits_config(**{"method.name": "fedala", "federation.rounds": 2})
    run_dir, _ = run_experiment(two, remote=InProcessGrid(two, 2, state_root=tmp_path / "nodes").clients())
    assert sorted(p.name for p in (tmp_path / "nodes" / "node-1").iterdir()) == ["round-00001.pt", "round-00002.pt"]
    resumed = resume_config(run_dir, ["federation.rounds=4"])
    grid = InProcessGrid(resumed, 2, state_root=tmp_path / "nodes")  # a new Flower run: empty node contexts
    run_experiment(resumed, run_dir, remote=grid.clients(resume=2))
    assert_same_metrics(run_dir, sequential_dir)
    with pytest.raises(PlflError, match="cannot resume round 2: .* has no state-dir"):
        InProcessGrid(resumed, 2).clients(resume=2)


def test_a_node_killed_mid_run_leaves_its_clients_out_and_the_run_goes_on(digits_config, flower_identity):
    """Node 101 (clients 1 and 3) is killed in round 2's training: no reply in that round (the SuperLink still
    lists it), then, once the SuperLink counts it offline, Flower's error replies (code 5). Its clients fail their
    trainings under the failure policy, miss the broadcasts and drop out of the evaluations; the run goes on."""
    cfg = digits_config(**{"federation.rounds": 3})
    grid = InProcessGrid(cfg, 2)
    send, killed_in = grid.send_and_receive, []

    def node_101_killed_in_round_2(messages, timeout=None):
        replies = []
        for m in messages:
            round_ = m.content["config"].get("round")
            if m.metadata.dst_node_id == 101 and m.metadata.message_type == "train" and round_ == 2:
                killed_in.append(round_)
            if m.metadata.dst_node_id != 101 or not killed_in:
                replies.extend(send([m]))
            elif round_ == 3:
                m.metadata.__dict__["_message_id"] = m.object_id  # sent: the grid gives it its id
                replies.append(Message(error=Error(5, "SuperNode 101 is unavailable"), reply_to=m))
        return replies

    grid.send_and_receive = node_101_killed_in_round_2
    with pytest.warns(UserWarning, match="2 clients could not be evaluated: client 1: SuperNode 101: no reply in time"):
        run_dir, summary = run_experiment(cfg, remote=grid.clients())
    assert summary["status"] == "completed" and summary["rounds"] == 3
    failures = [(f["round"], f["client"], f["reason"]) for f in summary["client_failures"]]
    lost, gone = "SuperNode 101: no reply in time", "SuperNode 101: SuperNode 101 is unavailable"
    assert failures == [  # training, then broadcast, of rounds 2 and 3
        *[(2, 1, lost), (2, 3, lost), (2, 1, lost), (2, 3, lost)],
        *[(3, 1, gone), (3, 3, gone), (3, 1, gone), (3, 3, gone)],
    ]
    rows = metrics(run_dir)
    assert [r.get("unreachable_clients", "") for r in rows] == ["", "", "2", "2"]
    assert [r["failed_clients"] for r in rows] == ["", "0", "2", "2"]
    with (run_dir / "clients.csv").open() as f:
        evaluated = [(int(r["round"]), int(r["client"])) for r in csv.DictReader(f)]
    assert (3, 1) not in evaluated and (3, 0) in evaluated and (1, 1) in evaluated


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_flowers_simulation_runtime_gives_the_sequential_executors_metrics(digits_config, method):
    cfg = digits_config(**{"method.name": method, "federation.rounds": 3})
    sequential_dir, _ = run_experiment(cfg)
    outcome = run_simulation(cfg, 3, {"client_resources": {"num_cpus": 1}})
    assert outcome["summary"]["status"] == "completed"
    assert_same_metrics(outcome["run_dir"], sequential_dir)


@pytest.mark.slow
def test_plfl_flower_runs_a_config_file_on_supernodes_and_resumes_it(tmp_path, capsys):
    config = tmp_path / "digits.yaml"
    config.write_text("data: {source: digits, num_clients: 4}\nmodel: {name: mlp}\nfederation: {rounds: 1}\n")
    args = ["flower", "run", "--config", str(config), "--nodes", "2", f"output_dir={tmp_path}", "progress_bar=false"]
    assert main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "final" in out and "Run directory:" in out
    (run_dir,) = (tmp_path / "fedavg-digits").iterdir()
    assert sorted(p.name for p in (run_dir / "node-state").iterdir()) == ["node-0", "node-1"]
    assert main(["flower", "run", "--resume", str(run_dir), "--nodes", "2", "federation.rounds=2"]) == 0
    assert [r["round"] for r in metrics(run_dir)] == ["0", "1", "2"]


def test_flwr_runs_read_the_plfl_config_and_overrides_from_the_run_config(tmp_path):
    config = tmp_path / "digits.yaml"
    config.write_text("data: {source: digits, num_clients: 4}\nmodel: {name: mlp}\n")
    context = Context(1, 0, {}, RecordDict(), {"config": str(config), "overrides": "federation.rounds=2 method=ditto"})
    cfg, resume = run_config(context)
    assert (cfg.federation.rounds, cfg.method.name, cfg.data.num_clients, resume) == (2, "ditto", 4, None)
    with pytest.raises(ConfigError, match=r"\[tool.flwr.app.config\] config = "):
        run_config(Context(1, 0, {}, RecordDict(), {}))


def test_plfl_flower_split_writes_each_nodes_clients_and_says_how_to_start_it(tmp_path, capsys):
    config = tmp_path / "digits.yaml"
    config.write_text("data: {source: digits, num_clients: 5}\nmodel: {name: mlp}\n")
    assert main(["flower", "split", "--config", str(config), "--nodes", "2", "--output", str(tmp_path / "n")]) == 0
    out = capsys.readouterr().out
    assert f'--node-config "data-dir={tmp_path / "n" / "node-0"}"' in out
    data, clients = read_node_data(tmp_path / "n" / "node-0")
    assert clients == [0, 2, 4] and data.clients[1].num_train == 0 and data.clients[2].num_train > 0
    assert main(["flower", "split", "--config", str(config), "--nodes", "6", "--output", str(tmp_path)]) == 2
    assert "--nodes 6: each node holds one of the 5 clients at least" in capsys.readouterr().err
