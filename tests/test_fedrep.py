"""FedRep: head epochs then body epochs, each freezing the other part; the head never leaves the client."""

import pytest
import torch

from plfl.experiment import run_experiment
from plfl.methods.fedrep import FedRep, FedRepConfig
from plfl.seeding import derive_seed

from conftest import last_metrics, make_context, run_hook, sequential


def make_method(data, **keys):
    context, model = make_context(data)
    return FedRep(FedRepConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_head_epochs_leave_body_bit_identical_and_body_epochs_leave_head_bit_identical(tiny_federation):
    method, context = make_method(tiny_federation, head_epochs=2)
    received = method.server_message(1, round_=0)
    start = method.pre_local_init(1, received, round_=0)
    calls = []  # (task, result) of each training
    executor = sequential(context)
    train = executor.train

    def recorded(tasks):
        calls.extend(zip(tasks, results := train(tasks)))
        return results

    executor.train = recorded
    result = run_hook(context, method.local_train(1, start, received, round_=1), executor)
    (head_task, head), (body_task, body) = calls
    assert head_task.seed == derive_seed(0, 1, 1, "head_training")
    assert body_task.seed == derive_seed(0, 1, 1, "local_training")
    assert head_task.params is start and body_task.params is head.params and result.params is body.params
    for key, value in start.items():
        in_head = key.startswith("head.")
        assert torch.equal(head.params[key], value) != in_head, key  # only the head moved
        assert torch.equal(body.params[key], head.params[key]) == in_head, key  # only the body moved
    n = tiny_federation.clients[1].num_train
    assert result.samples_seen == (2 + 1) * n
    torch.testing.assert_close(result.loss, (2 * head.loss + body.loss) / 3)


def test_client_keeps_its_head_and_takes_the_averaged_body(tiny_federation):
    method, context = make_method(tiny_federation)
    initial = {k: v.clone() for k, v in context.architecture.state_dict().items()}
    for client_id in range(4):
        context.store.set(client_id, "model", method.pre_local_init(client_id, method.server_message(client_id, 0), 0))
    own = {k: torch.full_like(v, 3.0 + (k.startswith("head.") * 4.0)) for k, v in initial.items()}
    context.store.set(0, "model", own)
    other = {k: torch.full_like(v, 5.0) for k, v in initial.items()}
    method.aggregate({0: method.shared(own), 1: method.shared(other)}, round_=1)
    n0, n1 = tiny_federation.clients[0].num_train, tiny_federation.clients[1].num_train  # 10, 20
    assert set(method.server_message(0, round_=1)) == {k for k in initial if k.startswith("body.")}
    kept = method.pre_local_init(0, method.server_message(0, round_=1), round_=1)
    fresh = method.pre_local_init(3, method.server_message(3, round_=1), round_=1)  # never trained: the initial head
    for key in initial:
        if key.startswith("head."):
            assert torch.all(kept[key] == 7.0) and torch.equal(fresh[key], initial[key])
        else:
            assert torch.allclose(kept[key], torch.full_like(kept[key], (3 * n0 + 5 * n1) / (n0 + n1)))
            assert torch.equal(fresh[key], kept[key])


@pytest.mark.parametrize("method, shared", [("fedrep", "body"), ("lgfedavg", "head")])
def test_only_the_shared_part_is_sent_or_received(digits_config, method, shared):
    """FedRep's head and LG-FedAvg's body never leave the client: hand-counted bytes per round."""
    run_dir, summary = run_experiment(digits_config(**{"method.name": method, "federation.join_ratio": 0.4}))
    last = last_metrics(run_dir)
    # digits: 64 inputs, MLP [32], 10 classes; float32. Body 64·32 + 32, head 32·10 + 10.
    size = {"body": 4 * (64 * 32 + 32), "head": 4 * (32 * 10 + 10)}
    assert summary["num_parameters"] * 4 == size["body"] + size["head"]
    assert int(last["bytes_sent"]) == 5 * size[shared]  # every client, every round
    assert int(last["bytes_received"]) == 2 * size[shared]  # the 2 sampled clients
    assert float(last["accuracy"]) > 0.2  # 10 classes: chance is 0.1 (measured 0.33)
