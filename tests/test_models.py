"""Models: FedAvg's CNN dimensions, body/head split, input-shape errors, and the BatchNorm option."""

import pytest
import torch
from torch import nn

from plfl.batches import EpochShuffle
from plfl.client import ClientModule, LocalTrainer, build_trainer
from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.models import build_model


@pytest.mark.parametrize("shape, flat", [((1, 28, 28), 1024), ((3, 32, 32), 1600)])
def test_cnn_flattened_dimension_and_head(shape, flat):
    model = build_model("cnn", shape, 10)
    assert model.body[7].in_features == flat  # the fc 512 layer after two conv/pool stages
    assert model.head.in_features == 512 and model.head.out_features == 10
    names = [n for n, _ in model.named_parameters()]
    assert names[-2:] == ["head.weight", "head.bias"]  # FedALA's p = 2 is the head
    assert model(torch.zeros(2, *shape)).shape == (2, 10)


@pytest.mark.parametrize("shape, flat, params", [((3, 32, 32), 400, 62_006), ((1, 28, 28), 256, 44_426)])
def test_lenet5_layers_and_parameter_count(shape, flat, params):
    """62,006 parameters on CIFAR-10: 456 + 2,416 (convs) + 48,120 + 10,164 (fc 120, fc 84) + 850 (head)."""
    model = build_model("lenet5", shape, 10)
    assert [m.out_channels for m in model.body if isinstance(m, nn.Conv2d)] == [6, 16]
    assert [(m.in_features, m.out_features) for m in model.body if isinstance(m, nn.Linear)] == [(flat, 120), (120, 84)]
    assert (model.head.in_features, model.head.out_features) == (84, 10)
    assert sum(p.numel() for p in model.parameters()) == params
    assert model(torch.zeros(2, *shape)).shape == (2, 10)


def test_resnet18_and_mlp_expose_body_and_head():
    resnet = build_model("resnet18", (1, 28, 28), 7)
    assert resnet.body(torch.zeros(2, 1, 28, 28)).shape == (2, 512)
    assert resnet(torch.zeros(2, 1, 28, 28)).shape == (2, 7)
    mlp = build_model("mlp", (1, 8, 8), 10, hidden_sizes=[32, 16])
    assert mlp.body(torch.zeros(3, 1, 8, 8)).shape == (3, 16)


def test_mclr_is_softmax_regression_on_the_flattened_input():
    model = build_model("mclr", (1, 2, 2), 3)
    assert list(model.body.parameters()) == []
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 2, 0, 0], [0, 0, 0, -1]]))
        model.head.bias.copy_(torch.tensor([0.0, 0.5, 1.0]))
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    # logits: 1·1, 2·2 + 0.5, −1·4 + 1
    assert model(x).tolist() == [[1.0, 4.5, -3.0]]
    assert sum(p.numel() for p in model.parameters()) == 3 * 4 + 3


def test_cnn_on_too_small_images_says_what_to_use():
    with pytest.raises(
        ConfigError, match="needs images of at least 16×16 pixels; the data are 8×8. Use model.name=mlp"
    ):
        build_model("cnn", (1, 8, 8), 10)


@pytest.mark.parametrize(
    "name, shape, norms",
    [
        ("cnn", (1, 28, 28), [nn.BatchNorm2d, nn.BatchNorm2d, nn.BatchNorm1d]),
        ("mlp", (1, 8, 8), [nn.BatchNorm1d, nn.BatchNorm1d]),
        ("lenet5", (3, 32, 32), [nn.BatchNorm2d, nn.BatchNorm2d, nn.BatchNorm1d, nn.BatchNorm1d]),
    ],
)
def test_batch_norm_option_puts_a_batch_norm_before_every_relu(name, shape, norms):
    keys = {"hidden_sizes": [32, 16]} if name == "mlp" else {}
    plain = list(build_model(name, shape, 10, **keys).body)
    body = list(build_model(name, shape, 10, **keys, batch_norm=True).body)
    assert [type(m) for m in body if not isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d))] == list(map(type, plain))
    found = [
        (type(body[i]), body[i - 1], body[i + 1])
        for i, m in enumerate(body)
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d))
    ]
    assert [t for t, _, _ in found] == norms and len(found) == sum(isinstance(m, nn.ReLU) for m in body)
    for _, before, after in found:
        assert isinstance(after, nn.ReLU) and isinstance(before, (nn.Conv2d, nn.Linear))


def test_batch_norm_with_resnet18_is_refused(tmp_path):
    (tmp_path / "run.yaml").write_text("model: {name: resnet18}\n")
    with pytest.raises(ConfigError, match="resnet18 always has BatchNorm layers. Remove model.batch_norm"):
        load_config(tmp_path / "run.yaml", ["model.batch_norm=true"])


def test_a_last_batch_of_one_sample_is_left_out_with_batch_norm(tiny_federation):
    client = tiny_federation.clients[0]
    x, y = client.x_train[:6], client.y_train[:6]  # batches of 5 and 1
    model = build_model("mlp", (8,), 3, hidden_sizes=[4], batch_norm=True)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        model.train()(x[:1])  # why: BatchNorm cannot normalise one sample in training
    trainer = LocalTrainer(ClientModule(model, 3, lr=0.1), build_trainer("cpu", 1, "32-true"), 5)
    result = trainer.train({k: v.clone() for k, v in model.state_dict().items()}, x, y, seed=0, epochs=3)
    assert result.samples_seen == 3 * 5
    left_out = []
    for epoch in range(8):
        shuffle = EpochShuffle(6, seed=0, first_epoch=0, size=5)
        shuffle.set_epoch(epoch)
        left_out.append(({*range(6)} - set(shuffle)).pop())
    assert len(set(left_out)) > 1  # a different sample in different epochs
