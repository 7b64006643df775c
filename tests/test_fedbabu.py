"""FedBABU: the head keeps its initial weights through federated training, the body is averaged, and every client
fine-tunes the whole model in the last round only."""

import pytest
import torch

from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.methods.fedbabu import FedBABU, FedBABUConfig

from conftest import ROOT, make_context, run_hook

HEAD = {"head.weight", "head.bias"}


def make_method(tiny_federation, fine_tuning_epochs=2):
    context, model = make_context(tiny_federation, rounds=3)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    return FedBABU(FedBABUConfig(fine_tuning_epochs=fine_tuning_epochs), context, initial), context, initial


def test_the_body_trains_under_the_frozen_initial_head_and_only_the_body_is_sent(tiny_federation):
    method, context, initial = make_method(tiny_federation)
    received = method.server_message(0, round_=0)
    assert set(received) == set(initial) - HEAD  # the head is never sent
    start = run_hook(context, method.pre_local_init(0, received, round_=0))
    trained = run_hook(context, method.local_train(0, start, received, round_=1))
    for key, value in initial.items():
        assert torch.equal(trained.params[key], value) == (key in HEAD)  # the body moves, the head does not
    message = method.client_message(0, trained, round_=1)
    assert set(message) == set(initial) - HEAD

    other = {k: torch.full_like(v, 5.0) for k, v in initial.items()}
    method.aggregate({0: message, 1: method.shared(other)}, round_=1)
    n0, n1 = tiny_federation.clients[0].num_train, tiny_federation.clients[1].num_train  # 10, 20
    global_model = method.global_model(1)
    for key in initial:
        expected = initial[key] if key in HEAD else (n0 * trained.params[key] + n1 * 5.0) / (n0 + n1)
        torch.testing.assert_close(global_model[key], expected)
    # Before the last round every client holds and evaluates the global model, whatever it trained before.
    context.store.set(0, "model", trained.params)
    for client in (0, 3):
        model = run_hook(context, method.pre_local_init(client, method.server_message(client, 1), round_=1))
        assert all(torch.equal(model[k], v) for k, v in global_model.items())


def trained(task):
    return (yield task)


def test_the_last_round_fine_tunes_body_and_head_from_the_global_model(tiny_federation):
    method, context, initial = make_method(tiny_federation)
    message = method.server_message(2, round_=3)
    tuned = run_hook(context, method.pre_local_init(2, message, round_=3))
    global_model = method.global_model(3)
    assert all(not torch.equal(tuned[k], v) for k, v in global_model.items())  # body and head both fine-tuned
    # Two epochs of plain training from the global model, on the "fine_tuning" batch order.
    expected = run_hook(context, trained(method.train_task(2, global_model, 3, "fine_tuning", epochs=2)))
    assert all(torch.equal(tuned[k], v) for k, v in expected.params.items())

    untuned, context, _ = make_method(tiny_federation, fine_tuning_epochs=0)
    kept = run_hook(context, untuned.pre_local_init(2, untuned.server_message(2, round_=3), round_=3))
    assert all(torch.equal(kept[k], v) for k, v in untuned.global_model(3).items())


def test_training_after_a_fine_tuned_round_starts_from_the_received_body(tiny_federation):
    # A run continued past its last round: the client's model is fine-tuned, its next training ignores it.
    method, context, initial = make_method(tiny_federation)
    message = method.server_message(1, round_=3)
    tuned = run_hook(context, method.pre_local_init(1, message, round_=3))
    from_tuned = run_hook(context, method.local_train(1, tuned, message, round_=4))
    from_global = run_hook(context, method.local_train(1, method.global_model(3), message, round_=4))
    assert all(torch.equal(from_tuned.params[k], v) for k, v in from_global.params.items())


def test_fedbabu_has_no_ala_and_checks_its_epochs():
    with pytest.raises(ConfigError, match="Unknown config key 'method.ala'"):
        load_config(ROOT / "configs" / "fedbabu.yaml", ["method.ala.s=50"])
    with pytest.raises(ConfigError, match="'method.fine_tuning_epochs' must be an integer >= 0; got -1"):
        load_config(ROOT / "configs" / "fedbabu.yaml", ["method.fine_tuning_epochs=-1"])
