"""FedProto: prototypes, their aggregation, the regulariser and the nearest-prototype head by hand, the client loop
against an independent autograd one, what is sent both ways (prototypes only), what is evaluated, and its keys
(no ALA; momentum and data.augment are refused as for every method with its own steps)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from plfl.batches import batch_loader
from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.methods.base import nbytes
from plfl.methods.fedproto import ABSENT_LOGIT, FedProto, FedProtoConfig, prototype_classifier
from plfl.seeding import derive_seed

from conftest import ROOT, last_metrics, make_context, run_hook, run_loop, sequential

CONFIG = ROOT / "configs" / "fedproto.yaml"


def make_method(data, federation=None, **keys):
    context, model = make_context(data, **{"lr": 0.1, "batch_size": 5, **(federation or {})})
    return FedProto(FedProtoConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_prototype_head_picks_the_nearest_global_prototype_and_never_an_absent_class():
    table = torch.tensor([[0.0, 0.0], [0.1, 0.1], [4.0, 0.0]])  # class 1 absent, though nearest to everything
    present = torch.tensor([1.0, 0.0, 1.0])
    weight, bias = prototype_classifier(table, present)
    features = torch.tensor([[1.0, 0.5], [3.0, -1.0], [2.1, 0.0], [1.9, 3.0]])
    logits = features @ weight.T + bias
    distances = torch.cdist(features, table[[0, 2]]).square()
    assert logits.argmax(1).tolist() == [[0, 2][j] for j in distances.argmin(1).tolist()] == [0, 2, 2, 0]
    assert (logits[:, 1] == ABSENT_LOGIT).all()
    # Up to a term common to all classes, the logits are minus the mean squared distances (PFLlib's MSE).
    shift = features.square().sum(1, keepdim=True) / 2
    torch.testing.assert_close(logits[:, [0, 2]] - shift, -distances / 2)


def test_client_loop_matches_an_independent_autograd_one(tiny_federation):
    lam, lr, client, round_ = 0.5, 0.1, 1, 3  # client 1: 20 samples, 4 batches of 5
    method, context = make_method(tiny_federation, lam=lam)
    g = torch.Generator().manual_seed(1)
    own = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in method.initial_params.items()}
    received = {"prototype/0": torch.randn(16, generator=g), "prototype/2": torch.randn(16, generator=g)}
    head = {k: own[k] for k in ("head.weight", "head.bias")}
    context.store.set(client, "fedproto_head", head)
    evaluated = run_hook(context, method.pre_local_init(client, received, round_ - 1))  # the prototype head
    assert not torch.equal(evaluated["head.weight"], head["head.weight"])
    context.store.set(client, "model", {**own, **{k: evaluated[k] for k in head}})
    evaluated = run_hook(context, method.pre_local_init(client, received, round_ - 1))
    result = run_hook(context, method.local_train(client, evaluated, received, round_))

    local = copy.deepcopy(context.architecture)
    local.load_state_dict(own)  # the client's own body and its own head, not the evaluated one
    data = tiny_federation.clients[client]
    features = {j: [] for j in range(3)}
    for x, y in batch_loader(data.x_train, data.y_train, 5, derive_seed(0, round_, client, "local_training")):
        rep = local.body(x)
        target = rep.detach().clone()
        for i, label in enumerate(y.tolist()):
            if f"prototype/{label}" in received:
                target[i] = received[f"prototype/{label}"]
            features[label].append(rep[i].detach())
        loss = F.cross_entropy(local.head(rep), y) + lam * F.mse_loss(target, rep)
        grads = torch.autograd.grad(loss, list(local.parameters()))
        with torch.no_grad():
            for p, grad in zip(local.parameters(), grads):
                p -= lr * grad
    for key, value in local.state_dict().items():
        torch.testing.assert_close(result.params[key], value)
    upload = method.client_message(client, result, round_)
    assert upload is result.upload and list(upload) == [f"prototype/{j}" for j in range(3) if features[j]]
    for j, seen in features.items():
        if seen:
            torch.testing.assert_close(upload[f"prototype/{j}"], torch.stack(seen).mean(0))
    kept = context.store.get(client, "fedproto_head")
    assert all(torch.equal(kept[k], result.params[k]) for k in head)  # the trained head is kept
    assert result.samples_seen == data.num_train


def test_only_prototypes_travel_and_clients_classify_by_the_nearest_one(tiny_federation):
    method, context = make_method(tiny_federation, {"rounds": 2})
    assert method.server_message(0, 0) == {}  # nothing to send before the first aggregation
    loop = run_loop(method, context)
    first, last = loop.history[0].metrics, loop.history[-1].metrics
    assert first["bytes_sent"] == 0
    # Every client saw every class of its training split; 16-d float32 prototypes.
    classes = [len(c.y_train.unique()) for c in tiny_federation.clients]
    assert last["bytes_received"] == sum(classes) * 16 * 4
    assert list(method.global_params) == ["prototype/0", "prototype/1", "prototype/2"]
    assert last["bytes_sent"] == 4 * nbytes(method.global_params) == 4 * 3 * 16 * 4
    for row in loop.history[-1].clients:
        client, data = row["client"], tiny_federation.clients[row["client"]]
        model = context.store.get(client, "model")
        kept = context.store.get(client, "fedproto_head")
        assert not torch.equal(model["head.weight"], kept["head.weight"])  # evaluated: the prototype head
        net = copy.deepcopy(context.architecture)
        net.load_state_dict(model)
        with torch.no_grad():
            table = torch.stack(list(method.global_params.values()))
            nearest = torch.cdist(net.body(data.x_test), table).argmin(1)
        assert (nearest == data.y_test).sum().item() == row["correct"]
        assert sequential(context).trainer.evaluate(model, data.x_test, data.y_test).correct == row["correct"]


def test_head_inference_evaluates_the_clients_own_model(tiny_federation):
    method, context = make_method(tiny_federation, {"rounds": 2}, inference="head")
    run_loop(method, context)
    for client in range(len(tiny_federation.clients)):
        model, kept = context.store.get(client, "model"), context.store.get(client, "fedproto_head")
        assert all(torch.equal(model[k], v) for k, v in kept.items())


def test_keys_are_checked_and_there_is_no_ala():
    assert load_config(CONFIG, []).method.inference == "prototypes"
    with pytest.raises(ConfigError, match=r"Config key 'method.inference' must be one of prototypes, head"):
        load_config(CONFIG, ["method.inference=logits"])
    with pytest.raises(ConfigError, match=r"Config key 'method.lam' must be a number >= 0; got -1.0."):
        load_config(CONFIG, ["method.lam=-1"])
    # A client's own model is its local initialisation: ALA (FedALA's Table 4) has no received model to use.
    with pytest.raises(ConfigError, match="Unknown config key 'method.ala'"):
        load_config(CONFIG, ["method.ala.s=50"])


def test_momentum_is_refused(tiny_federation):
    with pytest.raises(ConfigError, match="fedproto takes plain gradient steps"):
        make_method(tiny_federation, {"momentum": 0.5})


@pytest.mark.slow
def test_fedproto_config_runs_end_to_end(digits_config):
    run_dir, _ = run_experiment(digits_config(**{"method.name": "fedproto", "federation.rounds": 5}))
    last = last_metrics(run_dir)
    assert float(last["accuracy"]) > 0.5  # 10 classes: chance is 0.1 (measured 0.77; FedAvg's 0.39)
    assert 0 < float(last["bytes_sent"]) < 5 * 10 * 32 * 4 + 1  # prototypes of 32 features, 10 classes at most
