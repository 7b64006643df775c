"""Poisoned clients (attack.*): the malicious set, each attack's message against hand-computed values, label
flipping, the run's outputs, and the refusals."""

import csv
import json

import pytest
import torch

from plfl import experiment
from plfl.attacks import (
    Attack,
    check_images,
    flip_labels,
    gaussian,
    plant_backdoor,
    scaled,
    sign_flipped,
    triggered_test_clients,
    with_trigger,
)
from plfl.data import ClientData, FederatedData
from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.sections import AttackConfig
from plfl.seeding import derive_seed, malicious_clients

from conftest import matrix_config


@pytest.fixture
def images() -> FederatedData:
    """3 clients of 6, 9 and 4 random 2×6×6 images, 3 classes."""
    g = torch.Generator().manual_seed(0)
    clients = [
        ClientData(
            torch.rand(n, 2, 6, 6, generator=g),
            torch.randint(0, 3, (n,), generator=g),
            torch.rand(5, 2, 6, 6, generator=g),
            torch.randint(0, 3, (5,), generator=g),
        )
        for n in (6, 9, 4)
    ]
    return FederatedData("images", clients, num_classes=3, input_shape=(2, 6, 6))


SENT = {"w": torch.tensor([1.0, -1.0]), "n": torch.tensor(3)}
TRAINED = {"w": torch.tensor([1.5, 1.0]), "n": torch.tensor(4)}  # u = (0.5, 2)


def test_sign_flip_sends_the_update_reversed_and_scaled():
    flipped = sign_flipped(TRAINED, SENT, 3.0)
    assert flipped["w"].tolist() == [1 - 1.5, -1 - 6.0] and flipped["n"].item() == 4  # integers as trained


def test_scale_sends_the_update_scaled():
    assert scaled(TRAINED, SENT, 3.0)["w"].tolist() == [1 + 1.5, -1 + 6.0]


def test_gaussian_sends_the_received_model_plus_seeded_noise():
    seed = derive_seed(0, 2, 1, "attack_noise")
    noise = torch.randn((2,), generator=torch.Generator().manual_seed(seed)) * 0.5
    attack = Attack(AttackConfig(kind="gaussian", fraction=0.5, noise_std=0.5), frozenset({1}), seed=0)
    sent = attack.message("fedavg", 1, TRAINED, SENT, 2)
    assert torch.equal(sent["w"], SENT["w"] + noise)
    assert torch.equal(gaussian(TRAINED, SENT, 0.5, seed)["w"], sent["w"])
    assert not torch.equal(attack.message("fedavg", 1, TRAINED, SENT, 3)["w"], sent["w"])  # new noise each round


def test_honest_clients_and_label_flipping_leave_the_message_as_it_is():
    attack = Attack(AttackConfig(kind="sign_flip", fraction=0.5), frozenset({1}), seed=0)
    assert attack.message("fedavg", 0, TRAINED, SENT, 1) is TRAINED
    flip = Attack(AttackConfig(kind="label_flip", fraction=0.5), frozenset({1}), seed=0)
    assert flip.message("fedavg", 1, TRAINED, SENT, 1) is TRAINED


def test_a_model_attack_refuses_an_upload_that_is_not_a_model_beside_the_received_one():
    attack = Attack(AttackConfig(kind="scale", fraction=0.5), frozenset({1}), seed=0)
    with pytest.raises(ConfigError) as error:
        attack.message("scaffold", 1, {"delta/w": torch.zeros(2)}, SENT, 1)
    assert str(error.value) == (
        "attack.kind=scale changes a client's model update θ_i − θ_sent, but scaffold's upload is not a model beside "
        "the one its clients receive (it sends other tensors, or nothing). Set attack.kind=label_flip, which works "
        "for every method, or attack a method that uploads models."
    )


@pytest.mark.parametrize("fraction, count", [(0.0, 0), (0.2, 4), (0.01, 1), (0.5, 10)])
def test_the_malicious_clients_are_a_seeded_share_of_the_clients(fraction, count):
    chosen = malicious_clients(7, 20, fraction)
    assert len(chosen) == count and chosen <= set(range(20))
    assert malicious_clients(7, 20, fraction) == chosen  # the same seed, the same clients
    if count:
        assert any(malicious_clients(seed, 20, fraction) != chosen for seed in range(8, 12))


def test_label_flipping_flips_only_the_malicious_clients_training_labels(tiny_federation):
    flipped = flip_labels(tiny_federation, frozenset({1, 3}))
    for i, (old, new) in enumerate(zip(tiny_federation.clients, flipped.clients)):
        expected = 2 - old.y_train if i in (1, 3) else old.y_train  # C = 3: y → 2 − y
        assert torch.equal(new.y_train, expected)
        assert torch.equal(new.y_test, old.y_test) and torch.equal(new.x_train, old.x_train)


def test_a_run_marks_its_malicious_clients_and_trains_them_on_flipped_labels(digits_config, monkeypatch):
    built, build = {}, experiment.build_executor

    def executor_of(work, options, data, model):  # keeps the data the executors train on
        built["data"] = data
        return build(work, options, data, model)

    monkeypatch.setattr(experiment, "build_executor", executor_of)
    config = digits_config(**{"attack.kind": "label_flip", "attack.fraction": 0.4})
    run_dir, summary = run_experiment(config)
    malicious = summary["malicious_clients"]
    assert malicious == sorted(malicious_clients(0, 5, 0.4)) and len(malicious) == 2
    original = experiment.load_federated_data(config.data, 0)
    for i, (old, new) in enumerate(zip(original.clients, built["data"].clients)):
        flipped = old.y_train if i not in malicious else 9 - old.y_train  # digits: C = 10
        assert torch.equal(new.y_train, flipped) and torch.equal(new.y_test, old.y_test)
    with open(run_dir / "clients.csv") as f:
        rows = list(csv.DictReader(f))
    assert {int(r["client"]) for r in rows if r["malicious"] == "True"} == set(malicious)
    assert json.loads((run_dir / "summary.json").read_text())["malicious_clients"] == malicious


def test_prototype_methods_refuse_model_attacks(digits_config):
    with pytest.raises(ConfigError) as error:
        run_experiment(digits_config(**{"method.name": "fedproto", "attack.kind": "gaussian", "attack.fraction": 0.2}))
    assert "attack.kind=gaussian changes a client's model update θ_i − θ_sent, but fedproto's upload" in str(
        error.value
    )


@pytest.mark.parametrize("method", ["scaffold", "fedas", "fedpac", "local"])
def test_methods_whose_upload_is_no_model_refuse_model_attacks_before_the_run(digits_config, tmp_path, method):
    with pytest.raises(ConfigError, match=f"attack.kind=sign_flip changes .*, but {method}'s upload is not a model"):
        run_experiment(digits_config(**{"method.name": method, "attack.kind": "sign_flip", "attack.fraction": 0.2}))
    assert not list(tmp_path.rglob("config.yaml"))  # refused before a run directory was made


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"attack.kind": "sign_flip"},
            "attack.kind=sign_flip with attack.fraction=0.0: an attack needs malicious clients and malicious clients "
            "an attack. Set both (e.g. attack.kind=sign_flip attack.fraction=0.2) or neither.",
        ),
        ({"attack.fraction": 0.2}, "attack.kind=none with attack.fraction=0.2: an attack needs malicious clients"),
        (
            {"attack.kind": "gaussian", "attack.fraction": 0.2, "attack.scale": 5},
            "attack.scale=5.0 is read only by attack.kind=sign_flip or scale, not by attack.kind=gaussian. Remove "
            "attack.scale (or set attack.kind=sign_flip).",
        ),
        ({"attack.fraction": 1.0}, "Config key 'attack.fraction' must be a number in [0, 1); got 1.0."),
        (
            {"attack.kind": "label_flip", "attack.fraction": 0.2, "attack.target": 3},
            "attack.target=3 is read only by attack.kind=backdoor, not by attack.kind=label_flip.",
        ),
    ],
)
def test_attack_keys_are_checked(digits_config, overrides, message):
    with pytest.raises(ConfigError) as error:
        digits_config(**overrides)
    assert message in str(error.value)


def test_the_trigger_is_a_bottom_right_patch_of_the_peak_in_every_channel():
    x = torch.zeros(2, 3, 5, 6)
    triggered = with_trigger(x, 2.0)
    assert triggered[:, :, 2:, 3:].eq(2.0).all() and triggered.sum() == 2 * 3 * 9 * 2.0
    assert x.eq(0).all()  # a copy


def test_a_backdoor_poisons_a_share_of_the_malicious_clients_training_images_only(digits_config):
    data = experiment.load_federated_data(digits_config().data, 0)
    config = AttackConfig(kind="backdoor", fraction=0.4, target=7, poison_fraction=0.25)
    planted = plant_backdoor(data, frozenset({1, 3}), config, seed=0)
    for i, (old, new) in enumerate(zip(data.clients, planted.clients)):
        changed = (new.x_train != old.x_train).flatten(1).any(dim=1) | (new.y_train != old.y_train)
        assert torch.equal(new.x_test, old.x_test) and torch.equal(new.y_test, old.y_test)
        if i not in (1, 3):
            assert not changed.any()
            continue
        poisoned = torch.isclose(new.x_train[..., -3:, -3:], torch.tensor(1.0)).flatten(1).all(dim=1)
        assert poisoned.sum() == round(0.25 * old.num_train) and new.y_train[poisoned].eq(7).all()
        assert torch.equal(new.y_train[~poisoned], old.y_train[~poisoned]) and changed.sum() <= poisoned.sum()
    again = plant_backdoor(data, frozenset({1, 3}), config, seed=0)
    assert all(torch.equal(a.x_train, b.x_train) for a, b in zip(again.clients, planted.clients))


def test_the_backdoor_is_measured_on_triggered_test_images_of_the_other_classes(images):
    triggered = triggered_test_clients(images, target=1)
    for client, test in zip(images.clients, triggered):
        others = client.y_test != 1
        assert test.num_train == 0 and test.y_test.eq(1).all() and len(test.y_test) == others.sum()
        peak = max(c.x_train.max() for c in images.clients)
        assert torch.equal(test.x_test, with_trigger(client.x_test[others], peak))


def test_a_backdoor_refuses_inputs_that_are_not_images_and_a_target_outside_the_classes(tiny_federation, images):
    with pytest.raises(ConfigError) as error:
        check_images(tiny_federation, 0)
    assert str(error.value) == (
        "attack.kind=backdoor puts a 3×3 trigger patch on images (C, H, W), but tiny's inputs have shape (8,). "
        "Choose an image data source, or another attack.kind."
    )
    with pytest.raises(ConfigError) as error:
        check_images(images, images.num_classes)
    assert f"attack.target={images.num_classes} is not a class of" in str(error.value)


def test_a_backdoor_succeeds_against_the_mean_and_less_against_the_median(digits_config):
    """10 digits clients, 3 of them training on half their images triggered and labelled 0: FedAvg's mean learns
    the backdoor, the median much less; both keep their clean accuracy."""
    common = {
        "data.num_clients": 10,
        "data.beta": 5.0,
        "federation.rounds": 8,
        "federation.lr": 0.1,
        "federation.batch_size": 10,
        "attack.kind": "backdoor",
        "attack.fraction": 0.3,
    }
    summaries = {
        rule: run_experiment(digits_config(**common, **{"aggregation.rule": rule}))[1] for rule in ("mean", "median")
    }
    success = {rule: s["final_backdoor_success"] for rule, s in summaries.items()}
    assert success["mean"] > 0.8 and success["median"] < success["mean"] - 0.3, success
    assert min(s["final_accuracy"] for s in summaries.values()) > 0.6, summaries


@pytest.mark.parametrize("attack", ["backdoor", "sign_flip"])
def test_poisoned_clients_under_a_robust_rule_train_vectorized_as_sequential(tmp_path, attack):
    """The same poisoned clients and trimmed mean on the vectorized executor: the sequential executor's clean
    accuracy and backdoor success per round, to 4 decimals."""
    keys = {"attack.kind": attack, "attack.fraction": 0.4, "aggregation.rule": "trimmed_mean"}
    runs = [run_experiment(matrix_config(tmp_path / e, "fedavg", e, **keys))[0] for e in ("sequential", "vectorized")]
    columns = ("accuracy", "backdoor_success") if attack == "backdoor" else ("accuracy",)
    sequential, vectorized = (
        [
            [round(float(row[c]), 4) for c in columns]
            for row in csv.DictReader((run / "metrics.csv").read_text().splitlines())
        ]
        for run in runs
    )
    assert vectorized == sequential and len(sequential) == 4
