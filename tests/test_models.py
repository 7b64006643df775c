"""Models: FedAvg's CNN dimensions, body/head split, and input-shape errors."""

import pytest
import torch

from plfl.errors import ConfigError
from plfl.models import build_model


@pytest.mark.parametrize("shape, flat", [((1, 28, 28), 1024), ((3, 32, 32), 1600)])
def test_cnn_flattened_dimension_and_head(shape, flat):
    model = build_model("cnn", shape, 10, [])
    assert model.body[7].in_features == flat  # the fc 512 layer after two conv/pool stages
    assert model.head.in_features == 512 and model.head.out_features == 10
    names = [n for n, _ in model.named_parameters()]
    assert names[-2:] == ["head.weight", "head.bias"]  # FedALA's p = 2 is the head
    assert model(torch.zeros(2, *shape)).shape == (2, 10)


def test_resnet18_and_mlp_expose_body_and_head():
    resnet = build_model("resnet18", (1, 28, 28), 7, [])
    assert resnet.body(torch.zeros(2, 1, 28, 28)).shape == (2, 512)
    assert resnet(torch.zeros(2, 1, 28, 28)).shape == (2, 7)
    mlp = build_model("mlp", (1, 8, 8), 10, [32, 16])
    assert mlp.body(torch.zeros(3, 1, 8, 8)).shape == (3, 16)


def test_cnn_on_too_small_images_says_what_to_use():
    with pytest.raises(ConfigError, match="needs images of at least 16×16 pixels; the data are 8×8. Use model.name=mlp"):
        build_model("cnn", (1, 8, 8), 10, [])
