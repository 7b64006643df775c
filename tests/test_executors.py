"""Executors: the vectorized executor trains and evaluates as the sequential one does, and falls back with a notice."""

import csv
import warnings

import pytest
import torch

from plfl.checkpoint import load_latest_checkpoint
from plfl.client import ClientModule, TrainResult
from plfl.config import FederationConfig
from plfl.errors import ConfigError, PlflWarning
from plfl.executors import (ClientFailure, EvalTask, LocalAggregationTask, SequentialExecutor, TrainTask,
                            VectorizedExecutor, build_executor)
from plfl.executors.lockstep import shuffled_rows
from plfl.experiment import run_experiment
from plfl.methods.schemas import ALAConfig
from test_federation import make_context

# (method, options of both runs); FedAvg with momentum and short last batches (n mod 7 ≠ 0).
PARITY = [("fedavg", {"federation.momentum": 0.5, "federation.batch_size": 7}), ("local", {}),
          ("fedala", {"method.p": 2}), ("selffl", {"method.warmup_rounds": 1, "method.l_max": 5}),
          ("fedftha", {}), ("ditto", {}), ("fedrep", {}), ("fedavg_c", {}), ("fedprox", {"method.mu": 0.1}),
          ("pfedla", {}), ("heurpfedla", {"method.k": 1})]  # pFedLA: per-client start models from the server


def run(digits_config, executor, **options):
    """(per-round accuracies, per-client accuracies, every client's final model) of a 3-round digits run."""
    run_dir, _ = run_experiment(digits_config(**{"federation.executor": executor, **options}))
    with open(run_dir / "metrics.csv") as f:
        rounds = [float(row["accuracy"]) for row in csv.DictReader(f)]
    with open(run_dir / "clients.csv") as f:
        clients = [float(row["accuracy"]) for row in csv.DictReader(f)]
    store = load_latest_checkpoint(run_dir / "checkpoints")[1]["store"]
    return rounds, clients, [client["model"] for client in store]


@pytest.mark.parametrize("method, options", PARITY, ids=[m for m, _ in PARITY])
def test_vectorized_trains_and_evaluates_as_sequential(digits_config, method, options):
    options = {"method.name": method, **options}
    sequential = run(digits_config, "sequential", **options)
    vectorized = run(digits_config, "vectorized", **options, **{"federation.cohort_size": 3})  # 5 clients: 2 cohorts
    for one, other in zip(sequential[:2], vectorized[:2]):
        assert [round(a, 4) for a in one] == [round(a, 4) for a in other]
    for one, other in zip(sequential[2], vectorized[2]):
        assert one.keys() == other.keys()
        for key in one:
            torch.testing.assert_close(one[key], other[key], atol=1e-5, rtol=0)


def test_batch_order_is_local_trainers_across_fits_and_epochs(tiny_federation, monkeypatch):
    context, _ = make_context(tiny_federation)  # batch size 5
    seen = []
    step = ClientModule.training_step

    def recording(self, batch, batch_idx):
        seen.append(batch[0][:, 0].long().tolist())  # x[:, 0] holds the sample's index
        return step(self, batch, batch_idx)

    monkeypatch.setattr(ClientModule, "training_step", recording)
    x, y = torch.arange(23.0).unsqueeze(1).repeat(1, 8), torch.zeros(23, dtype=torch.long)
    for options in ({"epochs": 2}, {"steps": 7}, {"steps": 12}, {"epochs": 1}):  # steps run on into later epochs
        seen.clear()
        context.local_trainer.train(context.model.state_dict(), x, y, seed=11, **options)
        rows = shuffled_rows(23, 5, 11, **options)
        assert seen == [[i for i in row if i >= 0] for row in rows.tolist()]


def test_a_diverging_client_fails_alone(tiny_federation):
    context, model = make_context(tiny_federation)
    executor = VectorizedExecutor(tiny_federation, context.local_trainer, torch.device("cpu"), None, "32-true")
    start = {k: v.clone() for k, v in model.state_dict().items()}
    broken = {**start, "head.bias": torch.full_like(start["head.bias"], float("nan"))}
    tasks = [TrainTask(i, broken if i == 2 else start, seed=i, epochs=1) for i in range(4)]
    results = executor.train(tasks)
    assert results[2] == ClientFailure("its trained parameter 'body.1.weight' holds NaN or Inf (training diverged)")
    expected = SequentialExecutor(tiny_federation, context.local_trainer).train(tasks[:2] + tasks[3:])
    for result, alone in zip(results[:2] + results[3:], expected):
        assert isinstance(result, TrainResult) and result.samples_seen == alone.samples_seen
        for key in alone.params:
            torch.testing.assert_close(result.params[key], alone.params[key], atol=1e-6, rtol=0)


def test_batch_norm_falls_back_to_sequential_with_one_notice(digits_config):
    options = {"model.batch_norm": True, "federation.rounds": 1}
    with pytest.warns(PlflWarning) as caught:
        vectorized = run(digits_config, "vectorized", **options)
    notices = [str(w.message) for w in caught if "federation.executor" in str(w.message)]
    assert notices == ["federation.executor=vectorized runs this work on the sequential executor: the model's "
                       "BatchNorm layers update running statistics."]
    sequential = run(digits_config, "sequential", **options)
    assert vectorized[:2] == sequential[:2]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(vectorized[2], sequential[2]) for k in a)


def test_augmentation_falls_back_for_training_only(tiny_federation):
    context, model = make_context(tiny_federation)
    context.local_trainer.module.train_transform = lambda x, generator: x
    executor = VectorizedExecutor(tiny_federation, context.local_trainer, torch.device("cpu"), None, "32-true")
    start = model.state_dict()
    with pytest.warns(PlflWarning, match="runs this work on the sequential executor: data.augment draws random "
                                         "crops and flips.$"):
        executor.train([TrainTask(0, start, seed=0, epochs=1)])
    tasks = [EvalTask(1, start), EvalTask(None, start)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no notice: evaluation stays vectorized
        results = executor.evaluate(tasks)
    for result, expected in zip(results, SequentialExecutor(tiny_federation, context.local_trainer).evaluate(tasks)):
        assert result.correct == expected.correct and result.total == expected.total
        assert result.loss == pytest.approx(expected.loss, abs=1e-6)


def test_a_subset_of_the_training_split_trains_on_those_samples_only(tiny_federation):
    context, model = make_context(tiny_federation)
    executor = VectorizedExecutor(tiny_federation, context.local_trainer, torch.device("cpu"), None, "32-true")
    start, samples = {k: v.clone() for k, v in model.state_dict().items()}, torch.tensor([0, 2, 3, 5, 7])
    with pytest.warns(PlflWarning, match="part of a client's training split"):
        (result,) = executor.train([TrainTask(0, start, seed=0, epochs=1, samples=samples)])
    client = tiny_federation.clients[0]
    expected = context.local_trainer.train(start, client.x_train[samples], client.y_train[samples], seed=0, epochs=1)
    assert result.samples_seen == 5 and all(torch.equal(result.params[k], v) for k, v in expected.params.items())


def test_vectorized_needs_a_device_it_knows(tiny_federation):
    context, _ = make_context(tiny_federation)
    with pytest.raises(ConfigError, match="federation.executor=vectorized runs on trainer.accelerator cpu, gpu, cuda, "
                                          "mps or auto, not tpu. Set federation.executor=sequential."):
        build_executor(FederationConfig(executor="vectorized"), tiny_federation, context.local_trainer, "tpu",
                       "32-true")


@pytest.mark.parametrize("p, shared", [(2, True), (2, False), (3, True)],
                         ids=["head-only", "head-only-separate-messages", "with-body"])
def test_vectorized_ala_learns_the_weights_of_sequential_ala(tiny_federation, p, shared):
    """Clients in and after the initial stage together, in 2 cohorts: the same W_i, models and epochs as one
    client at a time (FedALA, Eq. 3–5), including clients that settle after different numbers of epochs; with
    one global model object for all clients (the body's features in one call) or a copy each."""
    context, model = make_context(tiny_federation)
    torch.manual_seed(1)
    states = [{k: v + 0.3 * torch.randn_like(v) for k, v in model.state_dict().items()} for _ in range(4)]
    config = ALAConfig(s=80, p=p, eta=2.0, threshold=0.02, num_pre_loss=2, max_init_epochs=6)
    top = [name for name, _ in model.named_parameters()][-p:]
    weights = [None, {k: torch.rand_like(states[1][k]) for k in top}, None, None]
    tasks = [LocalAggregationTask(i, states[0] if shared else dict(states[0]), states[i], weights[i], seed=10 + i,
                                  config=config) for i in range(4)]
    sequential = SequentialExecutor(context.data, context.local_trainer).aggregate_locally(tasks)
    vectorized = VectorizedExecutor(context.data, context.local_trainer, torch.device("cpu"), 2,
                                    "32-true").aggregate_locally(tasks)
    assert [o.epochs for o in vectorized] == [o.epochs for o in sequential]
    assert sequential[1].epochs == 1 and len({o.epochs for o in sequential}) > 1  # the initial stages differ
    for one, other in zip(sequential, vectorized):
        assert one.weights.keys() == other.weights.keys() == set(top)
        for key in one.params:
            torch.testing.assert_close(one.params[key], other.params[key], atol=1e-5, rtol=0)
        for key in one.weights:
            torch.testing.assert_close(one.weights[key], other.weights[key], atol=1e-5, rtol=0)
