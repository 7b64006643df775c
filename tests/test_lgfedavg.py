"""LG-FedAvg: every client keeps its body; the head is averaged; the body is never sent or received."""

import torch

from plfl.methods.lgfedavg import LGFedAvg

from conftest import make_context, run_hook


def test_client_keeps_its_body_and_takes_the_averaged_head(tiny_federation):
    context, model = make_context(tiny_federation)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    method = LGFedAvg(LGFedAvg.config_class(), context, initial)
    received = method.server_message(0, round_=0)
    start = method.pre_local_init(0, received, round_=0)
    trained = run_hook(context, method.local_train(0, start, received, round_=1))
    assert all(not torch.equal(trained.params[k], v) for k, v in start.items())  # the whole model trains
    message = method.client_message(0, trained, round_=1)
    assert set(message) == {"head.weight", "head.bias"}

    context.store.set(0, "model", trained.params)
    other = {k: torch.full_like(v, 5.0) for k, v in initial.items()}
    method.aggregate({0: message, 1: method.shared(other)}, round_=1)
    n0, n1 = tiny_federation.clients[0].num_train, tiny_federation.clients[1].num_train  # 10, 20
    kept = method.pre_local_init(0, method.server_message(0, round_=1), round_=1)
    fresh = method.pre_local_init(3, method.server_message(3, round_=1), round_=1)  # never trained: the initial body
    for key in initial:
        if key.startswith("head."):
            expected = (n0 * trained.params[key] + n1 * 5.0) / (n0 + n1)
            torch.testing.assert_close(kept[key], expected)
            assert torch.equal(fresh[key], kept[key])
        else:
            assert torch.equal(kept[key], trained.params[key]) and torch.equal(fresh[key], initial[key])
