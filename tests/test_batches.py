"""The one batch order (plfl.batches): the rows every loop trains on, and the BatchNorm rule that no method may
break."""

import warnings

import pytest
import torch

from plfl.batches import epoch_order, epoch_size, last_batch_minimum, padded_rows, sample_rows, training_rows
from plfl.data import ClientData, FederatedData
from plfl.errors import PlflWarning
from plfl.executors import VectorizedExecutor
from plfl.executors.options import ClientWorkOptions, Vectorized
from plfl.methods import method_class
from plfl.models import build_model
from plfl.sections import TrainerConfig

from conftest import every_method, make_context, run_loop, sequential


def test_training_rows_are_each_epochs_order_in_batches_with_a_short_last_batch_padded():
    rows = training_rows(7, 3, seed=5, epochs=2)
    first, second = epoch_order(7, 5, 0).tolist(), epoch_order(7, 5, 1).tolist()
    assert rows.tolist() == [first[0:3], first[3:6], [first[6], -1, -1], second[0:3], second[3:6], [second[6], -1, -1]]
    assert first != second  # a new order every epoch
    assert training_rows(7, 3, seed=5, steps=4).tolist() == rows[:4].tolist()  # steps run on into the next epoch


def test_a_last_batch_shorter_than_the_minimum_is_left_out():
    assert last_batch_minimum(5, batch_norm=False) == 1 and last_batch_minimum(5, batch_norm=True) == 2
    assert last_batch_minimum(10, batch_norm=True, sub_batches=2) == 7  # D of 5 and D' of at least 2
    assert last_batch_minimum(10, batch_norm=True, sub_batches=2, drop_last=True) == 10  # full batches only
    assert epoch_size(11, 5, 2) == 10 and epoch_size(12, 5, 2) == 12 and epoch_size(16, 10, 7) == 10
    rows = training_rows(11, 5, seed=0, epochs=1, min_last=2)
    assert rows.shape == (2, 5) and (rows >= 0).all()  # the 11th sample, a batch of one, is left out
    assert sample_rows(torch.tensor([4, 1, 9, 3]), 3, min_last=2).tolist() == [[4, 1, 9]]
    assert padded_rows(torch.tensor([4, 1, 9, 3]), 3).tolist() == [[4, 1, 9], [3, -1, -1]]


@pytest.fixture
def odd_clients() -> FederatedData:
    """Two clients whose batches of 5 end in a batch of one (11 training samples) or whose batches of 10 end in
    6, a sub-batch of one for Per-FedAvg's D, D′ (16 training samples)."""
    g = torch.Generator().manual_seed(0)
    return FederatedData(
        "odd",
        [
            ClientData(
                torch.randn(n, 8, generator=g),
                torch.randint(0, 3, (n,), generator=g),
                torch.randn(4, 8, generator=g),
                torch.randint(0, 3, (4,), generator=g),
            )
            for n in (11, 16)
        ],
        num_classes=3,
        input_shape=(8,),
    )


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
@pytest.mark.parametrize("name", every_method())
def test_no_method_leaves_a_client_out_for_a_batch_norm_batch_of_one(odd_clients, name, executor):
    """Every method with a BatchNorm model and batch size 5 trains both clients in both rounds: no batch (or
    sub-batch) of one sample reaches BatchNorm, whatever loop the method's training takes."""
    cls = method_class(name)
    model = build_model("mlp", odd_clients.input_shape, odd_clients.num_classes, hidden_sizes=[16], batch_norm=True)
    model = cls.client_network(model)  # the clients' network, as a run builds it
    context, _ = make_context(odd_clients, model=model, rounds=2)
    method = cls(cls.config_class(), context, {k: v.clone() for k, v in model.state_dict().items()})
    runner = sequential(context)
    if executor == "vectorized":
        work = ClientWorkOptions(context.federation, TrainerConfig())
        runner = VectorizedExecutor(odd_clients, model, work, Vectorized(), torch.device("cpu"), runner)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlflWarning)  # a client left out warns
        loop = run_loop(method, context, runner)
    assert loop.failures == [] and [r.metrics["failed_clients"] for r in loop.history[1:]] == [0, 0]
