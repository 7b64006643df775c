"""FedFTHA and FedFT: head-only fine-tuning, the head dictionary and FedHA's global head."""

import torch

from plfl.experiment import run_experiment
from plfl.methods.fedft import FedFT
from plfl.methods.fedftha import FedFTHA, FedFTHAConfig

from conftest import last_metrics, make_context, run_hook, sequential


def make_method(data, cls=FedFTHA, config=FedFTHAConfig, **keys):
    context, model = make_context(data)
    return cls(config(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def constant_message(method, body: float, head: float):
    return {k: torch.full_like(v, head if k in method.head_keys else body) for k, v in method.global_params.items()}


def test_head_epochs_leave_body_bit_identical(tiny_federation):
    method, context = make_method(tiny_federation, head_epochs=2)
    client = tiny_federation.clients[2]
    trained = sequential(context).trainer.train(method.global_params, client.x_train, client.y_train, seed=0, epochs=1)
    tuned = run_hook(context, method.post_train(2, trained, round_=1))
    for key, value in trained.params.items():
        same = torch.equal(tuned.params[key], value)
        assert same if key not in method.head_keys else not same, key
    assert tuned.samples_seen == 3 * client.num_train  # 1 joint + 2 head-only epochs


def test_global_head_is_mean_of_head_dictionary(tiny_federation):
    method, _ = make_method(tiny_federation)
    method.aggregate({0: constant_message(method, 1.0, 1.0), 1: constant_message(method, 2.0, 5.0)}, round_=1)
    method.aggregate({2: constant_message(method, 4.0, 9.0)}, round_=2)
    # Heads 1, 5 (kept from round 1) and 9: mean 5; the body is the mean of round 2's bodies only.
    assert all(torch.all(method.global_params[k] == 5.0) for k in method.head_keys)
    assert torch.all(method.global_params["body.1.weight"] == 4.0)
    method.aggregate({0: constant_message(method, 2.0, 4.0), 1: constant_message(method, 4.0, 8.0)}, round_=3)
    assert all(torch.all(method.global_params[k] == 7.0) for k in method.head_keys)  # (4 + 8 + 9) / 3
    assert torch.all(method.global_params["body.1.weight"] == 3.0)  # unweighted despite n_0 ≠ n_1


def test_never_trained_client_gets_global_head_trained_client_keeps_its_own(tiny_federation):
    method, context = make_method(tiny_federation)
    for client_id in range(4):
        context.store.set(client_id, "model", method.pre_local_init(client_id, method.server_message(client_id, 0), 0))
    own = constant_message(method, 1.0, 3.0)
    context.store.set(0, "model", own)
    method.aggregate({0: own, 1: constant_message(method, 1.0, 7.0)}, round_=1)
    assert set(method.server_message(0, round_=1)) == set(method.body(own))  # a trained client gets only the body
    kept = method.pre_local_init(0, method.server_message(0, round_=1), round_=1)
    fresh = method.pre_local_init(3, method.server_message(3, round_=1), round_=1)
    for key in method.head_keys:
        assert torch.all(kept[key] == 3.0)
        assert torch.all(fresh[key] == 5.0)  # the global head: mean of 3 and 7
    assert torch.equal(method.global_model(round_=1)["head.weight"], fresh["head.weight"])


def test_fedft_keeps_initial_head_and_has_no_global_model(tiny_federation):
    method, context = make_method(tiny_federation, cls=FedFT)  # FedFT takes FedFTHA's keys
    initial_head = method.global_params["head.weight"].clone()
    method.aggregate({0: constant_message(method, 1.0, 3.0)}, round_=1)
    fresh = method.pre_local_init(3, method.server_message(3, round_=1), round_=1)
    assert torch.equal(fresh["head.weight"], initial_head)
    assert method.global_model(round_=1) is None


def test_fedftha_reports_personalized_and_global_accuracy(digits_config):
    run_dir, summary = run_experiment(
        digits_config(
            **{
                "method.name": "fedftha",
                "method.head_epochs": 1,
                "federation.join_ratio": 0.4,
                "federation.momentum": 0.5,
            }
        )
    )
    last = last_metrics(run_dir)
    assert float(last["accuracy"]) > 0.6 and float(last["global_accuracy"]) > 0.3
    assert float(last["heads_stored"]) >= 2
    assert summary["params_sent_per_round"] < 5 * summary["num_parameters"]  # trained clients get only the body
