"""FedPer: every client keeps its head; the body is averaged; the head is never sent or received."""

import pytest
import torch

from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.methods.fedper import FedPer

from conftest import ROOT, make_context, run_hook


def test_client_keeps_its_head_and_takes_the_averaged_body(tiny_federation):
    context, model = make_context(tiny_federation)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    method = FedPer(FedPer.config_class(), context, initial)
    received = method.server_message(0, round_=0)
    assert not any(key.startswith("head.") for key in received)  # the head is never sent
    start = method.pre_local_init(0, received, round_=0)
    trained = run_hook(context, method.local_train(0, start, received, round_=1))
    assert all(not torch.equal(trained.params[k], v) for k, v in start.items())  # body and head train together
    message = method.client_message(0, trained, round_=1)
    assert set(message) == set(initial) - {"head.weight", "head.bias"}

    context.store.set(0, "model", trained.params)
    other = {k: torch.full_like(v, 5.0) for k, v in initial.items()}
    method.aggregate({0: message, 1: method.shared(other)}, round_=1)
    n0, n1 = tiny_federation.clients[0].num_train, tiny_federation.clients[1].num_train  # 10, 20
    kept = method.pre_local_init(0, method.server_message(0, round_=1), round_=1)
    fresh = method.pre_local_init(3, method.server_message(3, round_=1), round_=1)  # never trained: the initial head
    for key in initial:
        if key.startswith("head."):
            assert torch.equal(kept[key], trained.params[key]) and torch.equal(fresh[key], initial[key])
        else:
            expected = (n0 * trained.params[key] + n1 * 5.0) / (n0 + n1)
            torch.testing.assert_close(kept[key], expected)
            assert torch.equal(fresh[key], kept[key])


def test_fedper_has_no_ala():
    # Its own head is a client's local initialisation: ALA (FedALA's Table 4) has nothing to aggregate into.
    with pytest.raises(ConfigError, match="Unknown config key 'method.ala'"):
        load_config(ROOT / "configs" / "fedper.yaml", ["method.ala.s=50"])
