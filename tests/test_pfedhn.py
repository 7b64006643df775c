"""pFedHN: the generated model is what a client evaluates and trains from, a hypernetwork step moves it
towards the trained model, its state resumes exactly, and an end-to-end run."""

import copy

import torch

from plfl.experiment import run_experiment
from plfl.methods.pfedhn import PFedHN, PFedHNConfig
from plfl.seeding import derive_seed

from conftest import last_metrics, make_context, run_hook, run_loop, sequential


def make_method(data, **keys):
    context, model = make_context(data, rounds=1, batch_size=5)
    return PFedHN(PFedHNConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def distance(a, b):
    return sum((a[k] - b[k]).square().sum() for k in a).sqrt().item()


def test_the_generated_model_is_what_each_client_evaluates_and_trains_from(tiny_federation):
    method, context = make_method(tiny_federation)
    assert method.hypernetwork.embeddings.weight.shape == (4, 2)  # int(1 + 4/4)
    generated = method.server_message(2, round_=0)
    params = method.pre_local_init(2, generated, round_=0)
    assert all(torch.equal(params[k], v) for k, v in generated.items())
    assert not torch.equal(generated["head.weight"], method.server_message(1, round_=0)["head.weight"])  # per client
    result = run_hook(context, method.local_train(2, params, generated, round_=1))
    data = tiny_federation.clients[2]
    expected = sequential(context).trainer.train(
        generated, data.x_train, data.y_train, seed=derive_seed(0, 1, 2, "local_training"), epochs=1
    )
    assert all(torch.equal(result.params[k], v) for k, v in expected.params.items())
    assert all(torch.equal(result.upload[k], generated[k] - v) for k, v in expected.params.items())  # Δθ

    loop = run_loop(method, context)  # round 0 evaluates the generated models, round 1 those after the steps
    for row in loop.history[-1].clients:
        model = method.server_message(row["client"], round_=1)
        assert all(torch.equal(context.store.get(row["client"], "model")[k], v) for k, v in model.items())
        data = tiny_federation.clients[row["client"]]
        assert sequential(context).trainer.evaluate(model, data.x_test, data.y_test).correct == row["correct"]


def test_a_hypernetwork_step_moves_the_generated_model_towards_the_trained_one(tiny_federation):
    method, _ = make_method(tiny_federation, hn_lr=1e-3, hn_weight_decay=0.0)
    before = method.server_message(1, round_=0)
    g = torch.Generator().manual_seed(0)
    trained = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in before.items()}
    method.aggregate({1: {k: before[k] - trained[k] for k in before}}, round_=1)  # Δθ_1 = θ_1 − θ̃_1
    after = method.server_message(1, round_=1)
    assert distance(after, trained) < distance(before, trained)
    assert not torch.equal(method.server_message(0, round_=1)["head.weight"], before["head.weight"])  # φ is shared


def test_hypernetwork_and_momentum_resume_exactly(tiny_federation):
    method, fresh = make_method(tiny_federation)[0], make_method(tiny_federation)[0]
    deltas = [
        {1: {k: 0.01 * torch.ones_like(v) for k, v in method.server_message(1, round_=0).items()}} for _ in range(2)
    ]
    method.aggregate(deltas[0], round_=1)
    fresh.load_state_dict(copy.deepcopy(method.state_dict()))  # as from a checkpoint file: no shared tensors
    method.aggregate(deltas[1], round_=2)
    fresh.aggregate(deltas[1], round_=2)  # needs the saved momentum to take the same step
    for i in range(4):
        assert all(
            torch.equal(fresh.server_message(i, round_=2)[k], v) for k, v in method.server_message(i, round_=2).items()
        )


def test_pfedhn_runs_end_to_end(digits_config):
    run_dir, _ = run_experiment(digits_config(**{"method.name": "pfedhn"}))
    last = last_metrics(run_dir)
    assert float(last["accuracy"]) > 0.3  # 10 classes: chance is 0.1
    assert float(last["bytes_sent"]) == float(last["bytes_received"])  # θ_i down, Δθ_i up: one model each


def test_a_new_client_gets_the_model_of_the_mean_embedding(tiny_federation):
    method, _ = make_method(tiny_federation)
    with torch.no_grad():
        method.hypernetwork.embeddings.weight.normal_()
    new = method.new_client_model(0)
    mean = method.hypernetwork.embeddings.weight.mean(0)
    expected = method.hypernetwork.generate(mean)
    assert set(new) == set(method.global_params)
    assert all(torch.allclose(new[k], expected[k]) for k in expected)
    assert not torch.allclose(new["head.weight"], method.server_message(0, 0)["head.weight"])
