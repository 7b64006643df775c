"""FedEM: the E-step and the mixture's prediction by hand, the local solver's step against an independent autograd
loop, π kept on the client, one component reducing to FedAvg, what is sent, the mixture-weight table; and
``data.rotation_mixture``, the planted mixtures of rotations."""

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plfl.config import load_config
from plfl.data import load_federated_data
from plfl.data.loading import rotation_groups_of, rotation_mixture
from plfl.errors import ConfigError, DataError
from plfl.executors.steps import FunctionalNetwork
from plfl.methods.base import nbytes
from plfl.methods.fedavg import FedAvg, FedAvgConfig
from plfl.methods.fedem import (
    TABLE,
    WEIGHTS,
    WEIGHTS_HEATMAP,
    FedEM,
    FedEMConfig,
    FedEMForward,
    FedEMStep,
    component,
    mixture_entropy,
    mixture_log_probabilities,
    responsibilities,
)
from plfl.tasks import Batch, EvalTask

from conftest import ROOT, make_context, run_hook, run_loop, sequential

CONFIG = ROOT / "configs" / "fedem.yaml"


def make_method(data, components=3, **federation):
    context, model = make_context(data, **federation)  # lr 0.1, batch size 5
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return FedEM(FedEMConfig(components=components), context, initial), context, initial


def test_responsibilities_and_the_mixture_match_hand_computation():
    weights = torch.tensor([0.5, 0.25, 0.25])
    losses = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 0.0]])
    unnormalised = weights * torch.exp(-losses)
    torch.testing.assert_close(responsibilities(weights, losses), unnormalised / unnormalised.sum(1, keepdim=True))
    # A component of weight 0 takes no responsibility.
    q = responsibilities(torch.tensor([0.0, 1.0]), torch.tensor([[0.0, 5.0]]))
    assert q.tolist() == [[0.0, 1.0]]
    logits = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0))
    expected = torch.log((weights[:, None, None] * torch.softmax(logits, -1)).sum(0))
    torch.testing.assert_close(mixture_log_probabilities(weights, logits), expected)
    assert mixture_entropy(torch.full((3,), 1 / 3)) == pytest.approx(math.log(3))
    assert mixture_entropy(torch.tensor([1.0, 0.0])) == 0.0


@pytest.mark.parametrize("masked", [False, True])
def test_one_step_matches_an_independent_autograd_loop(masked):
    # Two learners of a linear model, a batch of three samples (with a padded fourth when masked).
    g = torch.Generator().manual_seed(1)
    received = {"weight": torch.randn(2, 3, 4, generator=g), "bias": torch.randn(2, 3, generator=g)}
    start = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in received.items()}
    x, y = torch.randn(4, 4, generator=g), torch.tensor([0, 2, 1, 1])
    weights = torch.tensor([0.3, 0.7])
    batch = Batch(x, y, torch.tensor([1.0, 1.0, 1.0, 0.0])) if masked else Batch(x[:3], y[:3], None)
    network = FunctionalNetwork(nn.Linear(4, 3), torch.device("cpu"))
    step = FedEMStep(("weight", "bias"), components=2, lr=0.5)
    out = step(network, start, {WEIGHTS: weights}, received, batch)
    # By hand: q from the received learners and π; each learner steps on (1/|B|) Σ_i q_im ℓ_im.
    xs, ys = x[:3], y[:3]
    losses = torch.stack([F.cross_entropy(xs @ received["weight"][m].T + received["bias"][m], ys, reduction="none")
                          for m in range(2)], dim=1)  # fmt: skip
    q = weights * torch.exp(-losses)
    q = q / q.sum(1, keepdim=True)
    total = 0.0
    for m in range(2):
        w, b = (start[k][m].clone().requires_grad_() for k in ("weight", "bias"))
        value = (q[:, m] * F.cross_entropy(xs @ w.T + b, ys, reduction="none")).mean()
        value.backward()
        total += value.item()
        torch.testing.assert_close(out.state["weight"][m], start["weight"][m] - 0.5 * w.grad)
        torch.testing.assert_close(out.state["bias"][m], start["bias"][m] - 0.5 * b.grad)
    assert out.loss.item() == pytest.approx(total, rel=1e-5)
    assert float(out.samples) == 3


def test_client_round_e_step_weights_kept_learners_uploaded(tiny_federation):
    method, context, initial = make_method(tiny_federation, local_epochs=1)
    client, data = 1, tiny_federation.clients[1]
    message = method.server_message(client, 0)
    assert message["head.weight"].shape[0] == 3 and WEIGHTS not in message  # M learners, never π
    assert torch.equal(message["head.weight"][0], initial["head.weight"])  # learner 0: the initial model
    assert not torch.equal(message["head.weight"][1], message["head.weight"][2])  # fresh, distinct draws
    model = method.pre_local_init(client, message, 0)
    torch.testing.assert_close(model[WEIGHTS], torch.full((3,), 1 / 3))
    result = run_hook(context, method.local_train(client, model, message, 1))
    # π^1 by hand: the mean over the training split of q with π^0 = 1/3 and the received learners.
    net = copy.deepcopy(context.architecture)
    losses = []
    for m in range(3):
        net.load_state_dict(component(message, m))
        with torch.no_grad():
            losses.append(F.cross_entropy(net(data.x_train), data.y_train, reduction="none"))
    expected = responsibilities(torch.full((3,), 1 / 3), torch.stack(losses, 1)).mean(0)
    torch.testing.assert_close(method.store.get(client, WEIGHTS), expected)
    torch.testing.assert_close(result.params[WEIGHTS], expected)
    assert set(result.upload) == set(initial) and result.upload["head.weight"].shape[0] == 3
    assert not torch.equal(result.upload["head.weight"], message["head.weight"])  # trained
    # The next broadcast evaluates the received learners with the client's own π; the other clients keep 1/3.
    again = method.pre_local_init(client, method.server_message(client, 1), 1)
    assert torch.equal(again[WEIGHTS], method.store.get(client, WEIGHTS))
    torch.testing.assert_close(method.pre_local_init(0, message, 1)[WEIGHTS], torch.full((3,), 1 / 3))


def test_the_evaluated_prediction_is_the_mixture_on_every_executor(tiny_federation):
    method, context, _ = make_method(tiny_federation)
    client, data = 2, tiny_federation.clients[2]
    model = {**method.server_message(client, 0), WEIGHTS: torch.tensor([0.2, 0.5, 0.3])}
    result = sequential(context).evaluate([EvalTask(client, model, forward=method.prediction())])[0]
    net = copy.deepcopy(context.architecture)
    probabilities = 0
    for m, w in enumerate((0.2, 0.5, 0.3)):
        net.load_state_dict(component(model, m))
        with torch.no_grad():
            probabilities = probabilities + w * torch.softmax(net(data.x_test), -1)
    assert result.correct == int((probabilities.argmax(1) == data.y_test).sum())
    assert result.loss == pytest.approx(F.nll_loss(probabilities.log(), data.y_test).item(), rel=1e-5)
    from plfl.executors import build_executor
    from plfl.executors.options import ClientWorkOptions, Vectorized
    from plfl.sections import TrainerConfig

    work = ClientWorkOptions(context.federation, TrainerConfig(), False)
    vectorized = build_executor(work, Vectorized(), tiny_federation, context.architecture)
    other = {**model, WEIGHTS: torch.tensor([0.9, 0.05, 0.05])}
    tasks = [EvalTask(client, model, forward=FedEMForward(3)), EvalTask(0, other, forward=FedEMForward(3))]
    expected, got = sequential(context).evaluate(tasks), vectorized.evaluate(tasks)
    assert [(r.correct, r.total) for r in got] == [(r.correct, r.total) for r in expected]
    assert [r.loss for r in got] == pytest.approx([r.loss for r in expected], rel=1e-5)


def test_one_component_is_fedavg_with_plain_sgd(tiny_federation):
    # M = 1: q = 1, π = 1, the weighted loss is the cross-entropy and the mixture the model's softmax.
    fedem, context, initial = make_method(tiny_federation, components=1, rounds=2, local_epochs=1)
    em_loop = run_loop(fedem, context)
    avg_context, _ = make_context(tiny_federation, rounds=2, local_epochs=1)
    fedavg = FedAvg(FedAvgConfig(), avg_context, {k: v.clone() for k, v in initial.items()})
    avg_loop = run_loop(fedavg, avg_context)
    for k, v in fedavg.global_params.items():
        torch.testing.assert_close(fedem.global_params[k][0], v, rtol=1e-5, atol=1e-6)
    for em, avg in zip(em_loop.history, avg_loop.history):
        assert em.metrics["accuracy"] == avg.metrics["accuracy"]


def test_a_run_counts_m_models_each_way_and_tables_the_weights(tiny_federation):
    method, context, _ = make_method(tiny_federation, rounds=2)
    loop = run_loop(method, context)
    learners = nbytes(method.global_params)  # all M learners
    assert loop.history[0].metrics["bytes_sent"] == 4 * learners
    for row in loop.history[1:]:  # full participation: M learners to and from each of the 4 clients
        assert row.metrics["bytes_sent"] == row.metrics["bytes_received"] == 4 * learners
    rows = loop.history[-1].tables[TABLE]
    assert [r["client"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        pis = [r[f"pi{m}"] for m in range(3)]
        assert sum(pis) == pytest.approx(1, rel=1e-5) and r["component"] == int(np.argmax(pis))
    entropy = np.mean([-sum(p * math.log(p) for p in (r[f"pi{m}"] for m in range(3)) if p > 0) for r in rows])
    assert loop.history[-1].metrics["mixture_entropy"] == pytest.approx(entropy, rel=1e-5)
    assert loop.history[0].metrics["mixture_entropy"] == pytest.approx(math.log(3))
    assert method.new_client_model(2) is None


def test_keys_are_checked_and_momentum_is_refused(tiny_federation):
    cfg = load_config(CONFIG, [])
    assert cfg.method.components == 3
    with pytest.raises(ConfigError, match=r"Config key 'method.components' must be an integer >= 1; got 0."):
        load_config(CONFIG, ["method.components=0"])
    with pytest.raises(ConfigError, match="fedem takes plain gradient steps"):
        make_method(tiny_federation, momentum=0.5)


def test_rotation_mixture_turns_each_sample_by_a_group_drawn_from_its_clients_proportions(digits_config):
    config = digits_config(**{"data.num_clients": 3, "data.rotation_groups": 4, "data.rotation_mixture": 0.5})
    mixed = load_federated_data(config.data, 0)
    config.data.rotation_groups, config.data.rotation_mixture = 1, None
    plain = load_federated_data(config.data, 0)
    drawn = rotation_groups_of(plain, 4, 0.5, 0)
    for i, (a, b, (proportions, train, test, _)) in enumerate(zip(mixed.clients, plain.clients, drawn)):
        assert np.allclose(proportions, rotation_mixture(i, 4, 0.5, 0)[0]) and np.isclose(proportions.sum(), 1)
        for turned, x, groups in ((a.x_train, b.x_train, train), (a.x_test, b.x_test, test)):
            for j in range(len(x)):  # quarter turns are exact
                assert torch.equal(turned[j], torch.rot90(x[j], int(groups[j]), dims=(1, 2)))
        assert torch.equal(a.y_train, b.y_train)
    assert len({tuple(p.round(6)) for p, *_ in drawn}) == 3  # each client its own proportions
    config.data.rotation_mixture = 0.5
    with pytest.raises(DataError, match="data.rotation_mixture=0.5 mixes rotation groups"):
        load_federated_data(config.data, 0)


def test_a_run_writes_the_weights_table_that_the_report_draws(digits_config):
    from plfl.experiment import run_experiment
    from plfl.report.figures import declared_plots, heatmaps_figure
    from plfl.report.runs import read_report_run

    run_dir, _ = run_experiment(digits_config(**{"method.name": "fedem", "federation.rounds": 2}))
    figure = heatmaps_figure(read_report_run(run_dir), WEIGHTS_HEATMAP)
    (heatmap,) = figure.data
    assert list(heatmap.x) == [0, 1, 2] and list(heatmap.y) == [0, 1, 2, 3, 4]  # components × clients
    assert np.allclose(np.sum(heatmap.z, axis=1), 1, atol=1e-6)  # each client's π, round 2
    assert "round 2" in figure.layout.title.text and WEIGHTS_HEATMAP in declared_plots()
