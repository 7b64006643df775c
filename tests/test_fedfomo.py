"""FedFomo: the first-order weights by hand, a model that raises the validation loss weighted 0, the
validation split, the affinity matrix's choice of M models, and bytes per round end to end."""

import pytest
import torch

from plfl.checkpoint import load_latest_checkpoint
from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.methods.base import nbytes
from plfl.methods.fedfomo import (
    SCORES,
    FedFomo,
    FedFomoConfig,
    fomo_scores,
    fomo_update,
    fomo_weights,
    validation_split,
)
from plfl.seeding import derive_seed

from conftest import make_context, run_hook, sequential


def test_weights_are_positive_gains_per_distance_normalised_over_the_positives():
    # L(w_i) = 1; L(θ_n) = 1.5, 0.5, 0.8 at distances 1, 2, 0.5: s = (−0.5, 0.25, 0.4) (up to the 1e-5).
    scores = fomo_scores(1.0, torch.tensor([1.5, 0.5, 0.8]), torch.tensor([1.0, 2.0, 0.5]))
    torch.testing.assert_close(scores, torch.tensor([-0.5, 0.25, 0.4]), rtol=1e-4, atol=0)
    weights = fomo_weights(scores)
    torch.testing.assert_close(weights, torch.tensor([0.0, 0.25 / 0.65, 0.4 / 0.65]), rtol=1e-4, atol=0)
    assert weights[0] == 0 and weights.sum().item() == pytest.approx(1.0)
    own = {"w": torch.tensor([1.0, 1.0]), "count": torch.tensor(4)}
    received = {"w": torch.tensor([[9.0, 9.0], [3.0, 1.0], [1.0, 4.0]])}
    updated = fomo_update(own, received, weights)  # w + Σ w_n (θ_n − w) = Σ w_n θ_n when Σ w_n = 1
    torch.testing.assert_close(updated["w"], torch.tensor([1 + 0.5 / 0.65, 1 + 1.2 / 0.65]))
    assert updated["count"] is own["count"]  # keys not received stay the client's
    none = fomo_weights(torch.tensor([-1.0, 0.0, -2.0]))  # no gain anywhere: the client keeps its model
    assert torch.equal(none, torch.zeros(3)) and torch.equal(fomo_update(own, received, none)["w"], own["w"])


def make_method(data, **keys):
    context, model = make_context(data, batch_size=5)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    return FedFomo(FedFomoConfig(**keys), context, initial), context, initial


def test_a_model_that_raises_the_validation_loss_gets_weight_zero(tiny_federation):
    method, context, own = make_method(tiny_federation, m=3, val_ratio=0.5)  # client 3: 40 samples, 20 held out
    data, (train, val) = tiny_federation.clients[3], method.splits[3]
    trainer = sequential(context).trainer
    # θ_0: own trained on the validation split itself (lower loss there), θ_1: own plus large noise (higher),
    # θ_2: own (no gain, weight 0 too).
    better = trainer.train(own, data.x_train[val], data.y_train[val], seed=1, epochs=20).params
    g = torch.Generator().manual_seed(0)
    worse = {k: v + 3 * torch.randn(v.shape, generator=g) for k, v in own.items()}
    method.models = {k: torch.stack([better[k], worse[k], own[k], own[k]]) for k in method.models}
    method.uploaded[:] = True

    def val_loss(p):
        return trainer.evaluate(p, data.x_train[val], data.y_train[val]).loss

    assert val_loss(better) < val_loss(own) < val_loss(worse)

    # local_train evaluates own and the three received models on the validation split (evaluation tasks), then trains.
    result = run_hook(context, method.local_train(3, own, method.server_message(3, round_=0), round_=1))
    scores = result.upload[SCORES]
    assert scores[0] > 0 and scores[1] < 0 and scores[2] == 0
    torch.testing.assert_close(fomo_weights(scores), torch.tensor([1.0, 0.0, 0.0]))
    # So local training started from θ_0, on the training part only.
    expected = trainer.train(
        better, data.x_train[train], data.y_train[train], seed=derive_seed(0, 1, 3, "local_training"), epochs=1
    )
    for key, value in expected.params.items():
        torch.testing.assert_close(result.params[key], value)
    assert result.samples_seen == len(train) == 20


def test_validation_split_is_a_seeded_partition_of_the_training_split():
    train, val = validation_split(10, 0.2, seed=7)
    assert len(val) == 2 and sorted(train.tolist() + val.tolist()) == list(range(10))
    assert torch.equal(validation_split(10, 0.2, seed=7)[1], val)
    assert any(not torch.equal(validation_split(10, 0.2, seed=s)[1], val) for s in range(8, 12))
    assert len(validation_split(3, 0.2, seed=0)[1]) == 1  # at least one sample each side
    with pytest.raises(ConfigError, match="2 or more training samples per client"):
        validation_split(1, 0.2, seed=0)


def test_clients_download_the_m_others_of_largest_affinity_which_accumulates_scores(tiny_federation):
    method, _, own = make_method(tiny_federation, m=2)
    assert method.server_message(0, round_=0) is None  # nothing uploaded yet
    method.uploaded[:] = True
    assert method.selection(0) == [1, 2]  # P = identity: ties go to the lower ids, never itself
    upload = {k: v.clone() for k, v in method.models.items()}
    messages = {j: {**{k: v[j] for k, v in upload.items()}, SCORES: torch.tensor([-1.0, 0.5])} for j in (0, 3)}
    method.aggregate(messages, round_=1)
    assert method.affinity[0].tolist() == [1.0, -1.0, 0.5, 0.0] and method.affinity[3].tolist() == [-1.0, 0.5, 0, 1]
    assert method.selection(0) == [2, 3] and method.selection(3) == [1, 2]


def test_fedfomo_runs_end_to_end_and_bytes_count_m_models_per_client(digits_config):
    run_dir, _ = run_experiment(digits_config(**{"method.name": "fedfomo", "method.m": 2}))
    header, *rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
    rows = [dict(zip(header, row)) for row in rows]
    model = nbytes(load_latest_checkpoint(run_dir / "checkpoints")[1]["method"]["global_params"])  # MLP: no buffers
    assert float(rows[0]["bytes_sent"]) == 0  # no uploads yet in round 0
    assert all(float(r["bytes_sent"]) == 5 * 2 * model for r in rows[1:])  # 5 clients × M = 2 models
    assert float(rows[1]["bytes_received"]) == 5 * model  # round 1 trained on nothing received: no scores
    assert all(float(r["bytes_received"]) == 5 * (model + 2 * 4) for r in rows[2:])  # model + M float32 scores
    assert float(rows[-1]["accuracy"]) > 0.3  # 10 classes: chance is 0.1
