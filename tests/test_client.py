"""plfl.batches' loader, ClientModule's attribute handling, the Trainer's float32 and input conversion."""

import math

import pytest
import torch
from torch import nn

from plfl.batches import EpochShuffle, batch_loader
from plfl.client import ClientModule, LocalTrainer, build_trainer


def test_batch_loader_cuts_each_epochs_shuffle_into_batches():
    x, y = torch.arange(23.0).unsqueeze(1), torch.arange(23)
    # 23 = 4·5 + 3: a last batch of 3, shorter than min_last = 4, is left out; each epoch visits 20 samples.
    loader = batch_loader(x, y, 5, seed=7, first_epoch=2, min_last=4)
    shuffle = EpochShuffle(23, seed=7, first_epoch=2, size=20)
    orders = []
    for epoch in (2, 3):
        loader.sampler.set_epoch(epoch)
        shuffle.set_epoch(epoch)
        batches = list(loader)
        assert len(loader) == 4 and [len(yb) for _, yb in batches] == [5, 5, 5, 5]
        assert all(torch.equal(xb.squeeze(1), yb.float()) for xb, yb in batches)  # x and y stay paired
        orders.append(torch.cat([yb for _, yb in batches]).tolist())
        assert orders[-1] == list(shuffle)
    assert orders[0] != orders[1]
    kept = batch_loader(x, y, 5, seed=7, first_epoch=2, min_last=3)  # a last batch of min_last samples is kept
    assert [len(yb) for _, yb in kept] == [5, 5, 5, 5, 3]
    in_order = [yb.tolist() for _, yb in batch_loader(x, y, 10)]
    assert in_order == [list(range(10)), list(range(10, 20)), [20, 21, 22]]


def test_client_module_attributes_keep_nn_module_semantics():
    module = ClientModule(nn.Linear(2, 2), 2, lr=0.1)
    module.samples_seen = 5
    assert module.samples_seen == 5
    module._loss_sum = torch.ones(())  # a buffer stays a buffer
    assert torch.equal(module._buffers["_loss_sum"], torch.ones(()))
    module.extra = nn.Linear(1, 1)
    assert "extra" in module._modules
    module.samples_seen = nn.Parameter(torch.zeros(1))  # a plain attribute turned parameter, as in nn.Module
    assert "samples_seen" in module._parameters and "samples_seen" not in module.__dict__


@pytest.fixture
def tf32_flags():
    """torch's TF32 flags, on before the test (cuDNN's default) and restored after it."""
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


@pytest.mark.parametrize("precision, tf32", [("32-true", False), ("bf16-mixed", True)])
def test_32_true_trainer_computes_in_ieee_float32(tf32_flags, precision, tf32):
    build_trainer("cpu", 1, precision)
    assert torch.backends.cudnn.allow_tf32 is tf32 and torch.backends.cuda.matmul.allow_tf32 is tf32


def test_local_training_converts_inputs_to_a_true_half_precision():
    """ClientModule takes its batches from dataloader_iter, past Lightning's per-batch input conversion:
    LocalTrainer converts a client's data once per fit, or a bf16 model would meet float32 inputs."""
    x, y = torch.randn(40, 8), torch.randint(0, 4, (40,))
    model = nn.Linear(8, 4)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = LocalTrainer(ClientModule(model, 4, lr=0.1), build_trainer("cpu", 1, "bf16-true"), 10)
    result = trainer.train(start, x, y, seed=0, epochs=1)
    assert result.samples_seen == 40 and torch.isfinite(torch.tensor(result.loss))
    assert {v.dtype for v in result.params.values()} == {torch.bfloat16}
    assert not torch.equal(result.params["weight"], start["weight"].bfloat16())  # four SGD steps moved it


def test_an_empty_split_evaluates_to_nothing_without_a_warning(recwarn):
    model = nn.Linear(8, 4)
    trainer = LocalTrainer(ClientModule(model, 4, lr=0.1), build_trainer("cpu", 1, "32-true"), 10)
    result = trainer.evaluate(model.state_dict(), torch.empty(0, 8), torch.empty(0, dtype=torch.long))
    assert (result.correct, result.total) == (0, 0) and math.isnan(result.loss)
    assert not recwarn.list, [str(w.message) for w in recwarn.list]
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    assert trainer.evaluate(model.state_dict(), x, y).total == 6
