"""kNN-Per (Marfoq et al., ICML 2022): the kNN model and Eq. 7 by hand, the datastore the broadcast builds, the λ
chosen on the validation split, and λ = 0 as FedAvg bit for bit (what is sent included)."""

import math

import pytest
import torch

from plfl.data import ClientData, FederatedData
from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.methods.knnper import (
    KEYS,
    LABELS,
    PRESENT,
    WEIGHT,
    KNNPer,
    KNNPerConfig,
    KNNPerForward,
    best_weight,
    interpolate,
    knn_probabilities,
)
from plfl.tasks import EvalResult, EvalTask, FeatureResult, FeatureTask

from conftest import ROOT, load_script, make_context, run_hook, run_results


def test_knn_probabilities_by_hand():
    # One query at the origin (F = 2); keys at squared distances 1, 4, 9 and a padded entry at distance 0.
    query = torch.tensor([[0.0, 0.0]])
    keys = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 0.0]])
    labels = torch.tensor([2, 0, 2, 1])
    present = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # k = 2, σ = 1: the two nearest real entries, weights ∝ exp(−1/2), exp(−4/2).
    p = knn_probabilities(query, keys, labels, present, neighbours=2, scale=1.0, num_classes=3)
    w1, w2 = math.exp(-0.5), math.exp(-2.0)
    torch.testing.assert_close(p, torch.tensor([[w2 / (w1 + w2), 0.0, w1 / (w1 + w2)]]))
    # k = 3, σ = 2: exp(−d²/(2·2)) for d² = 1, 4, 9; class 1 (only the padding) never gets a vote.
    p = knn_probabilities(query, keys, labels, present, neighbours=3, scale=2.0, num_classes=3)
    w = torch.tensor([math.exp(-1 / 4), math.exp(-4 / 4), math.exp(-9 / 4)])
    torch.testing.assert_close(p, torch.tensor([[w[1], 0.0, w[0] + w[2]]]) / w.sum())
    # More neighbours than entries: every real entry, padding weighs 0; a far query does not underflow to 0/0.
    far = torch.tensor([[1e3, 1e3]])
    p = knn_probabilities(far, keys, labels, present, neighbours=10, scale=1e-3, num_classes=3)
    assert torch.isfinite(p).all() and p.sum().item() == pytest.approx(1.0) and p[0, 1] == 0


def test_interpolation_by_hand_and_lambda_zero_is_the_models_logits():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    knn = torch.tensor([[0.0, 1.0, 0.0], [0.25, 0.75, 0.0]])
    softmax = torch.softmax(logits, -1)
    out = interpolate(logits, knn, torch.tensor(0.3), "probabilities")
    torch.testing.assert_close(out, torch.log(0.3 * knn + 0.7 * softmax))
    out = interpolate(logits, knn, torch.tensor(0.3), "logits")  # the authors' code: kNN probabilities + logits
    torch.testing.assert_close(out, 0.3 * knn + 0.7 * logits)
    for mode in ("probabilities", "logits"):
        assert torch.equal(interpolate(logits, knn, torch.tensor(0.0), mode), logits)
    # λ = 1: the kNN model alone, a class it never votes for floored, finite.
    out = interpolate(logits, knn, torch.tensor(1.0), "probabilities")
    assert torch.isfinite(out).all() and torch.equal(out.argmax(-1), knn.argmax(-1))


def test_best_weight_is_the_first_of_the_most_correct():
    results = [EvalResult(c, 10, 0.0) for c in (3, 7, 7, 5)]
    assert best_weight([0.0, 0.4, 0.6, 1.0], results) == 0.4


def method_of(data, **config):
    context, model = make_context(data)
    return KNNPer(KNNPerConfig(**config), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_the_datastore_holds_the_received_bodys_features_padded_to_the_largest(tiny_federation):
    method, context = method_of(tiny_federation, capacity=0.5, weight_grid=[])
    # ⌊0.5 n⌋ of n = 10, 20, 30, 40: the largest datastore holds 20 entries.
    samples = [method.datastore_samples(i) for i in range(4)]
    assert [len(s) for s in samples] == [5, 10, 15, 20] and method.capacity_max == 20
    assert all(torch.equal(s, s.unique()) for s in samples)  # distinct, in increasing order
    assert torch.equal(samples[1], method.datastore_samples(1))  # drawn once: the same every round
    message = {k: v.clone() for k, v in method.global_params.items()}
    model = run_hook(context, method.pre_local_init(1, message, round_=1))
    x = tiny_federation.clients[1].x_train[samples[1]]
    with torch.no_grad():
        expected = context.architecture.body(x)
    torch.testing.assert_close(model[KEYS][:10], expected)
    assert torch.equal(model[LABELS][:10], tiny_federation.clients[1].y_train[samples[1]])
    assert model[KEYS].shape == (20, expected.shape[1]) and not model[KEYS][10:].any()
    assert torch.equal(model[PRESENT], torch.tensor([1.0] * 10 + [0.0] * 10))
    assert model[WEIGHT].item() == 0.5  # no validation split: method.weight
    assert all(torch.equal(model[k], message[k]) for k in message)  # the global model as received


def test_lambda_is_tuned_on_the_validation_split(tiny_federation):
    clients = [
        ClientData(c.x_train, c.y_train, c.x_test, c.y_test, c.x_test[:4], c.y_test[:4])
        for c in tiny_federation.clients
    ]
    data = FederatedData("tiny-val", clients, num_classes=3, input_shape=(8,))
    method, _ = method_of(data, weight_grid=[0.0, 0.5, 1.0], neighbours=3)
    hook = method.pre_local_init(2, dict(method.global_params), round_=1)
    task = next(hook)
    assert isinstance(task, FeatureTask) and task.client_id == 2 and task.module == "body"
    features = FeatureResult(torch.randn(30, 16), torch.randint(0, 3, (30,)))
    tasks = hook.send(features)
    assert all(isinstance(t, EvalTask) and isinstance(t.forward, KNNPerForward) for t in tasks)
    # First the kNN model alone on the test split, then each λ of the grid on the validation split.
    assert [(t.split, t.params[WEIGHT].item()) for t in tasks] == [
        ("test", 1.0),
        ("val", 0.0),
        ("val", 0.5),
        ("val", 1.0),
    ]
    with pytest.raises(StopIteration) as stop:
        hook.send([EvalResult(9, 12, 0.1), EvalResult(2, 4, 0.1), EvalResult(3, 4, 0.1), EvalResult(3, 4, 0.1)])
    assert stop.value.value[WEIGHT].item() == 0.5
    assert method.round_metrics(1) == {"knnper_weight": 0.5, "knn_accuracy": 0.75, "knnper_datastore": 30.0}
    (row,) = method.round_tables(1)["knnper_clients"]
    assert row == {"round": 1, "client": 2, "weight": 0.5, "datastore": 30, "knn_accuracy": 0.75, "val_accuracy": 0.75}


def test_lambda_zero_is_fedavg_bit_for_bit(digits_config, tmp_path):
    fedavg = run_results(run_experiment(digits_config(**{"method.name": "fedavg"}))[0])
    knnper = run_results(
        run_experiment(digits_config(**{"method.name": "knnper", "method.weight": 0.0, "method.weight_grid": "[]"}))[0]
    )
    for ours, theirs in zip(knnper[0], fedavg[0]):  # every round: accuracy, loss and what was sent, both ways
        for key in ("accuracy", "bytes_sent", "bytes_received", "params_sent", "train_loss"):
            assert ours[key] == theirs[key], key
        # The same logits; the method's prediction sums their cross-entropy in other batches.
        assert float(ours["test_loss"]) == pytest.approx(float(theirs["test_loss"]), rel=1e-6)
        assert ours["global_accuracy"] == ours["accuracy"]  # the global model alone, λ = 0
    assert [r["accuracy"] for r in knnper[1]] == [r["accuracy"] for r in fedavg[1]]
    for ours, theirs in zip(knnper[2], fedavg[2]):
        assert set(ours) - set(theirs) == {KEYS, LABELS, PRESENT, WEIGHT}  # the datastore stays on the client
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # λ = 0.5 personalizes: the evaluated accuracy leaves the global model's.
    mixed = run_results(run_experiment(digits_config(**{"method.name": "knnper", "method.weight_grid": "[]"}))[0])
    assert [r["accuracy"] for r in mixed[0]] != [r["global_accuracy"] for r in mixed[0]]


@pytest.mark.parametrize(
    "override, message",
    [
        ("method.capacity=0", "Config key 'method.capacity' must be a number in (0, 1]; got 0.0."),
        ("method.weight=1.5", "Config key 'method.weight' must be a number in [0, 1]; got 1.5."),
        ("method.weight_grid=[0.5,2]", "Config key 'method.weight_grid' must be a list of numbers in [0, 1]"),
        ("method.neighbours=0", "Config key 'method.neighbours' must be an integer >= 1; got 0."),
    ],
)
def test_out_of_range_keys_are_refused(digits_config, override, message):
    key, value = override.split("=")
    with pytest.raises(ConfigError) as error:
        digits_config(**{"method.name": "knnper", key: value})
    assert message in str(error.value)


def test_a_model_without_a_linear_head_is_refused(tiny_federation):
    context, model = make_context(tiny_federation)
    model.head = torch.nn.Sequential(model.head)
    with pytest.raises(ConfigError, match="knnper mixes the head's prediction"):
        KNNPer(KNNPerConfig(), context, model.state_dict())


def test_lambda_is_tuned_per_client_in_a_run_with_validation_splits(digits_config):
    cfg = digits_config(**{"method.name": "knnper", "data.val_fraction": 0.2, "method.capacity": 0.5})
    assert list(cfg.method.weight_grid) == [i / 10 for i in range(11)]  # the default grid
    run_dir, summary = run_experiment(cfg)
    rows = run_results(run_dir)[0]
    assert summary["status"] == "completed" and all(0 <= float(r["knnper_weight"]) <= 1 for r in rows)
    assert (run_dir / "tables" / "knnper_clients.csv").exists()


def test_the_memory_benchmark_reproduces_the_runs_last_round(digits_config):
    script = load_script(ROOT / "benchmarks" / "knnper_memory.py")
    run_dir, _ = run_experiment(digits_config(**{"method.name": "knnper", "method.weight_grid": "[]"}))
    last = run_results(run_dir)[0][-1]
    round_, table = script.accuracy_table(run_dir, [0.2, 1.0], [0.0, 0.5, 1.0])
    assert round_ == 3 and set(table) == {0.2, 1.0}
    assert table[1.0][0.5] == float(last["accuracy"]) and table[1.0][1.0] == float(last["knn_accuracy"])
    assert table[0.2][0.0] == table[1.0][0.0] == float(last["global_accuracy"])  # λ = 0: the global model alone


def test_an_empty_datastore_leaves_the_global_model_alone(tiny_federation):
    method, _ = method_of(tiny_federation, weight_grid=[])
    hook = method.pre_local_init(0, dict(method.global_params), round_=1)
    next(hook)
    with pytest.raises(StopIteration) as stop:
        hook.send(FeatureResult(torch.zeros(0, 16), torch.zeros(0, dtype=torch.int64)))  # no evaluation asked
    model = stop.value.value
    assert model[WEIGHT].item() == 0.0 and not model[PRESENT].any()
    x = tiny_federation.clients[0].x_test
    network = lambda params, inputs, mask, module: (getattr(method.context.architecture, module)(inputs), {})  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(
            method.prediction()(network, model, x, torch.arange(len(x))), method.context.architecture(x)
        )
