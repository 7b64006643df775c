"""FedBN: BatchNorm layers stay on their client; the rest is FedAvg."""

import pytest
import torch

from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.methods.fedbn import FedBN
from plfl.methods.partial import module_keys
from plfl.models import build_model

from conftest import last_metrics, make_context, run_hook

BN_KEYS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def make_method(data, batch_norm=True):
    context, model = make_context(
        data, build_model("mlp", data.input_shape, data.num_classes, hidden_sizes=[16, 8], batch_norm=batch_norm)
    )
    return FedBN(FedBN.config_class(), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_batch_norm_keys_are_named_by_module_type(tiny_federation):
    method, context = make_method(tiny_federation)
    # flatten, (linear, BN, ReLU) × 2: the BN layers are body.2 and body.5
    assert method.local_keys == {f"body.{i}.{key}" for i in (2, 5) for key in BN_KEYS}
    assert module_keys(context.architecture, lambda name, _: name == "head") == {"head.weight", "head.bias"}


def test_a_model_without_batch_norm_is_refused(tiny_federation):
    with pytest.raises(ConfigError, match="the model has none. Set model.batch_norm=true"):
        make_method(tiny_federation, batch_norm=False)


def test_after_a_round_batch_norm_is_each_clients_own_and_the_rest_the_average(tiny_federation):
    method, context = make_method(tiny_federation)
    for client_id in range(4):
        context.store.set(client_id, "model", method.pre_local_init(client_id, method.server_message(client_id, 0), 0))
    trained, messages = {}, {}
    for client_id in (0, 1, 3):  # the loop's order: train, store, upload
        received = method.server_message(client_id, 0)
        result = run_hook(context, method.local_train(client_id, context.store.get(client_id, "model"), received, 1))
        context.store.set(client_id, "model", result.params)
        trained[client_id], messages[client_id] = result.params, method.client_message(client_id, result, 1)
    method.aggregate(messages, round_=1)
    models = {i: method.pre_local_init(i, method.server_message(i, 1), round_=1) for i in trained}
    n = {i: tiny_federation.clients[i].num_train for i in trained}
    for key in trained[0]:
        if key in method.local_keys:
            assert all(torch.equal(models[i][key], trained[i][key]) for i in trained), key  # its own
            if trained[0][key].is_floating_point():
                assert not torch.equal(models[0][key], models[1][key]), key  # and not a shared value
        else:
            average = sum(n[i] * trained[i][key] for i in trained) / sum(n.values())
            assert all(torch.allclose(models[i][key], average) for i in trained), key
    assert all(not set(m) & method.local_keys for m in messages.values())


def test_batch_norm_bytes_are_never_received(digits_config):
    run_dir, summary = run_experiment(digits_config(**{"method.name": "fedbn", "model.batch_norm": True}))
    last = last_metrics(run_dir)
    # digits: 64 inputs, MLP [32], 10 classes; float32. BN(32): γ, β, mean, var (float32) + an int64 count.
    model_bytes = 4 * (64 * 32 + 32 + 4 * 32 + 32 * 10 + 10) + 8
    bn_bytes = 4 * 4 * 32 + 8
    assert summary["num_parameters"] == 64 * 32 + 32 + 2 * 32 + 32 * 10 + 10
    assert int(last["bytes_received"]) == 5 * (model_bytes - bn_bytes)
    assert int(last["bytes_sent"]) == 5 * (model_bytes - bn_bytes)
    assert float(last["accuracy"]) > 0.5  # 10 classes: chance is 0.1 (measured 0.81)
