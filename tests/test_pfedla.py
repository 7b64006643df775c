"""pFedLA / HeurpFedLA: weight normalisation, the hypernetwork step's sign, what clients train from,
retained layers, BatchNorm statistics, similar clients found, and an end-to-end run."""

import csv
from pathlib import Path

import pytest
import torch
from torch import nn

from plfl.config import load_config
from plfl.data import ClientData, FederatedData
from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.methods.base import nbytes
from plfl.methods.heurpfedla import HeurpFedLA, HeurpFedLAConfig
from plfl.methods.pfedla import (
    LayerWeightNet,
    PFedLA,
    PFedLAConfig,
    hypernetwork_optimizer,
    layer_groups,
    mix,
    normalized,
)
from plfl.models import BodyHeadModel, build_model

from conftest import make_context, run_loop, sequential

ROOT = Path(__file__).resolve().parents[1]


def make_method(data, config=None, model=None, method=PFedLA, lr=0.1, **federation):
    """A pFedLA-family method on ``data`` (default: MLP with 16 hidden units) and its context."""
    context, model = make_context(data, model, **{"batch_size": 10, "lr": lr, **federation})
    config = config or method.config_class()
    return method(config, context, {k: v.detach().clone() for k, v in model.state_dict().items()}), context


def test_weights_are_distributions_and_dead_rows_fall_back_to_self():
    alpha = LayerWeightNet(client_id=2, num_clients=5, num_layers=3, embedding_dim=8, hidden_dim=8)()
    assert torch.equal(alpha, torch.full((3, 5), 0.2))  # softmax of zero outputs: uniform, none dead
    relu = LayerWeightNet(client_id=2, num_clients=5, num_layers=3, embedding_dim=8, hidden_dim=8, activation="relu")()
    assert relu.shape == (3, 5) and (relu > 0).all()  # the paper's ReLU: no weight starts dead either
    assert torch.allclose(relu.sum(1), torch.ones(3))
    outputs = torch.tensor([[-1.0, -2.0, 0.0], [1.0, 3.0, -1.0]], requires_grad=True)
    own = torch.tensor([0.0, 1.0, 0.0])
    alpha = normalized(outputs, own)
    assert torch.equal(alpha, torch.tensor([[0.0, 1.0, 0.0], [0.25, 0.75, 0.0]]))
    alpha.square().sum().backward()
    assert torch.isfinite(outputs.grad).all()  # the dead row passes no NaN gradient
    dead = LayerWeightNet(client_id=1, num_clients=4, num_layers=2, embedding_dim=8, hidden_dim=8, activation="relu")
    nn.init.constant_(dead.heads.bias, -1e3)
    assert torch.equal(dead(), torch.tensor([[0.0, 1.0, 0.0, 0.0]] * 2))


def test_one_hypernetwork_step_moves_the_mix_towards_the_trained_model(tiny_federation):
    method, _ = make_method(tiny_federation)
    torch.manual_seed(0)
    method.thetas = {key: 0.1 * torch.randn_like(t) for key, t in method.thetas.items()}  # distinct θ_j
    method.trained_any = True
    sent = method.server_message(0, round_=0)
    trained = {key: t[2].clone() for key, t in method.thetas.items()}  # θ_0^new: client 2's model

    def distance(params):
        return sum((params[k] - trained[k]).square().sum() for k in trained).sqrt()

    snapshot = method.thetas
    method.aggregate({0: trained}, round_=1)
    with torch.no_grad():
        alpha = method.hypernetworks[0]()
    moved = {key: mix(alpha[index], snapshot[key]) for index, keys in enumerate(method.layers.values()) for key in keys}
    assert distance(moved) < distance(sent)  # descent on ½‖θ̄_0 − θ_0^new‖² (a flipped sign increases it)
    assert (alpha[:, 2] > method.sent[0].alpha[:, 2]).all()  # client 2's weight grows in every layer
    assert all(torch.equal(method.thetas[k][0], trained[k]) for k in trained)  # θ_0 ← θ_0^new


def test_clients_train_from_the_personalized_model(tiny_federation):
    method, context = make_method(tiny_federation, rounds=3)
    trainer = sequential(context).trainer
    train = trainer.train
    checked = []

    def spy(params, x, y, **kwargs):
        client = next(i for i, c in enumerate(tiny_federation.clients) if c.x_train is x)
        with torch.no_grad():
            alpha = method.hypernetworks[client]()  # unchanged since the broadcast, as are the θ_j
        for index, keys in enumerate(method.layers.values()):
            for key in keys:
                assert torch.equal(params[key], mix(alpha[index], method.thetas[key]))
        checked.append(not all(torch.equal(params[k], method.thetas[k][client]) for k in method.thetas))
        return train(params, x, y, **kwargs)

    trainer.train = spy
    run_loop(method, context)
    assert len(checked) == 3 * 4
    assert all(checked[4:])  # from round 2 on θ̄_i is not the client's own stored θ_i


def test_heurpfedla_sends_less_and_retained_layers_stay_local(tiny_federation):
    model = build_model("mlp", tiny_federation.input_shape, tiny_federation.num_classes, hidden_sizes=[16])
    pfedla, _ = make_method(tiny_federation, model=model)
    heur0, _ = make_method(tiny_federation, HeurpFedLAConfig(k=0), model=model, method=HeurpFedLA)
    for i in range(4):  # k = 0 is pFedLA (same seeded hypernetworks)
        a, b = pfedla.server_message(i, round_=0), heur0.server_message(i, round_=0)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    heur, context = make_method(tiny_federation, HeurpFedLAConfig(k=1), method=HeurpFedLA, rounds=2)
    loop = run_loop(heur, context)
    sizes = {layer: sum(heur.thetas[k][0].numel() for k in keys) for layer, keys in heur.layers.items()}
    full = len(tiny_federation.clients) * sum(sizes.values())
    retained = [next(iter(sent.retained)) for sent in heur.sent]
    assert loop.history[-1].metrics["params_sent"] == full - sum(sizes[layer] for layer in retained)
    for i, layer in enumerate(retained):
        model = context.store.get(i, "model")
        for key in heur.layers[layer]:  # bit-identical to what client i trained and uploaded last round
            assert torch.equal(model[key], heur.thetas[key][i])
        assert not any(key in heur.server_message(i, round_=2) for key in heur.layers[layer])
    assert nbytes(heur.server_message(0, round_=2)) < nbytes(pfedla.server_message(0, round_=0))


def test_batchnorm_statistics_stay_local(tiny_federation):
    model = BodyHeadModel(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()), nn.Linear(16, 3))
    method, context = make_method(tiny_federation, model=model)
    assert list(layer_groups(model, "module")) == ["body.0", "body.1", "head"]
    assert list(layer_groups(model, "tensor"))[:2] == ["body.0.weight", "body.0.bias"]
    local = {k: v + 1.0 if v.is_floating_point() else v + 7 for k, v in model.state_dict().items()}
    context.store.set(0, "model", local)
    message = method.server_message(0, round_=0)
    assert not any("running" in key or "num_batches" in key for key in message)
    received = method.pre_local_init(0, message, round_=1)
    for key in ("body.1.running_mean", "body.1.running_var", "body.1.num_batches_tracked"):
        assert torch.equal(received[key], local[key])
    assert torch.equal(received["body.1.weight"], message["body.1.weight"])  # BatchNorm's affine part is aggregated


def two_groups() -> FederatedData:
    """8 clients on 4 well-separated Gaussian classes: clients 0–3 hold classes 0, 1; clients 4–7 classes 2, 3."""
    g = torch.Generator().manual_seed(0)
    means = 3 * torch.eye(4, 10)

    def draw(group: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 2, (n,), generator=g) + 2 * group
        return means[y] + 0.5 * torch.randn(n, 10, generator=g), y

    clients = [ClientData(*draw(i // 4, 40), *draw(i // 4, 20)) for i in range(8)]
    return FederatedData("two-groups", clients, num_classes=4, input_shape=(10,))


def test_weights_favour_clients_with_the_same_classes():
    method, context = make_method(two_groups(), rounds=8, eval_every=8)  # the default hypernetwork step
    run_loop(method, context)
    weights = method.weights().mean(dim=1)  # (client i, client j), mean over layers
    group = torch.arange(8) // 4
    same = group[:, None] == group[None, :]
    assert ((weights * same).sum(1) > (weights * ~same).sum(1)).all()  # every client: own group > other group
    peers = same & ~torch.eye(8, dtype=torch.bool)  # leave the self-weight out
    assert weights[peers].mean() > 2 * weights[~same].mean()
    assert (method.weights() > 0).all()  # softmax: no weight dies


# Fig. 5 of the paper: a target client (0), one with the same 4 classes (1), one sharing 3 of them (2), and
# clients whose classes are all different (3-7).
FIG5_CLASSES = [
    (0, 1, 2, 3),
    (0, 1, 2, 3),
    (0, 1, 2, 4),
    (4, 5, 6, 7),
    (4, 5, 6, 7),
    (5, 6, 7, 4),
    (6, 7, 4, 5),
    (7, 4, 5, 6),
]


def fig5_federation() -> FederatedData:
    g = torch.Generator().manual_seed(0)
    means = 3 * torch.eye(8, 12)

    def draw(classes: tuple[int, ...], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tensor(classes)[torch.randint(0, 4, (n,), generator=g)]
        return means[y] + 0.5 * torch.randn(n, 12, generator=g), y

    clients = [ClientData(*draw(c, 60), *draw(c, 20)) for c in FIG5_CLASSES]
    return FederatedData("fig5", clients, num_classes=8, input_shape=(12,))


def test_fig5_weights_order_same_over_similar_over_different_clients():
    method, context = make_method(fig5_federation(), rounds=10, eval_every=10)  # the default hypernetwork step
    run_loop(method, context)
    target = method.weights()[0].mean(dim=0)  # α_0^{·,j}, mean over layers
    same, similar, others = target[1], target[2], target[3:].max()
    assert same > similar > others
    assert target[0] > 2 / 8 and others < 0.5 / 8  # far from the uniform 1/8 after 10 rounds (measured: .46, .001)


def test_weights_stay_above_the_bound_and_clients_with_the_same_data_share_the_top_weight():
    method, context = make_method(fig5_federation(), rounds=30, eval_every=30)
    run_loop(method, context)
    weights = method.weights()  # (i, l, j)
    floor = torch.exp(torch.tensor(-2 * method.config.logit_bound))
    assert (weights >= floor * weights.max(dim=2, keepdim=True).values * 0.999).all()  # none one-hot, none at 0
    target = weights[0].mean(dim=0)
    assert abs(target[0] - target[1]) < 0.05 and target[1] > 0.4  # self and the same-data client (measured .49, .49)
    assert target[2:].max() < 0.05  # a client sharing 3 of 4 classes fell away by round 30 (measured .001)


def steps_until_weight_recovers(weight_decay: float) -> int:
    """Pull every layer's weight onto client 1 for 30 steps, then onto client 2: steps until client 2's is largest."""
    torch.manual_seed(0)
    hypernetwork = LayerWeightNet(0, 5, 2, embedding_dim=100, hidden_dim=100)
    optimizer = hypernetwork_optimizer(hypernetwork, PFedLAConfig(hn_weight_decay=weight_decay))

    def step(target: int) -> None:
        optimizer.zero_grad()
        (-hypernetwork()[:, target].log().sum()).backward()
        optimizer.step()

    for _ in range(30):
        step(1)
    assert hypernetwork()[:, 2].max() < 0.01  # at the floor
    for steps in range(1, 101):
        step(2)
        alpha = hypernetwork()
        if torch.equal(alpha.argmax(dim=1), torch.tensor([2, 2])):
            return steps
    return 101


def test_a_weight_at_the_floor_grows_back_when_its_gradient_turns():
    assert steps_until_weight_recovers(PFedLAConfig().hn_weight_decay) <= 5  # measured 2
    assert steps_until_weight_recovers(0.0) > 50  # without the decay the outputs ran past the bound (measured > 200)


def test_no_hypernetwork_step_while_every_stored_model_is_the_initial_one(tiny_federation):
    method, _ = make_method(tiny_federation)
    before = [p.clone() for p in method.hypernetworks[0].parameters()]
    method.server_message(0, round_=0)
    trained = {key: t[0] + 0.1 for key, t in method.thetas.items()}
    method.aggregate({0: trained}, round_=1)  # θ̄_0 was the initial model whatever α_0: no signal
    assert all(torch.equal(a, b) for a, b in zip(before, method.hypernetworks[0].parameters()))
    method.server_message(0, round_=1)  # now θ_0 differs from the other θ_j
    method.aggregate({0: trained}, round_=2)
    assert not all(torch.equal(a, b) for a, b in zip(before, method.hypernetworks[0].parameters()))


def test_end_to_end_run_writes_the_weight_table(digits_config):
    run_dir, summary = run_experiment(digits_config(**{"method.name": "pfedla", "method.weights_every": 2}))
    assert summary["status"] == "completed"
    with open(run_dir / "tables" / "aggregation_weights.csv") as f:
        rows = list(csv.DictReader(f))
    layers = ["body.1", "head"]  # the MLP's two Linear layers
    assert [(int(r["round"]), int(r["client"]), r["layer"]) for r in rows] == [
        (t, i, layer) for t in (0, 2, 3) for i in range(5) for layer in layers
    ]
    for row in rows:
        assert sum(float(row[f"w{j}"]) for j in range(5)) == pytest.approx(1, abs=1e-5)
    metrics = (run_dir / "metrics.csv").read_text().splitlines()
    assert "self_weight_mean" in metrics[0].split(",")


def test_config_checks(tiny_federation):
    cfg = load_config(ROOT / "configs" / "heurpfedla.yaml")
    assert cfg.method.k == 1 and cfg.method.granularity == "module"
    assert load_config(ROOT / "configs" / "pfedla.yaml").method.name == "pfedla"
    with pytest.raises(ConfigError, match="granularity"):
        load_config(None, ["method.name=pfedla", "method.granularity=block"])
    with pytest.raises(ConfigError, match="Unknown config key 'method.ala'"):  # the server personalizes instead
        load_config(None, ["method.name=pfedla", "method.ala.s=50"])
    with pytest.raises(ConfigError, match="method.k=3 exceeds"):
        make_method(tiny_federation, HeurpFedLAConfig(k=3), method=HeurpFedLA)


def test_a_new_client_gets_every_layer_mixed_with_uniform_weights(tiny_federation):
    """What a fresh hypernetwork gives under softmax (Eq. 3–6): the mean of the clients' θ_j, over the initial
    buffers."""
    method, _ = make_method(tiny_federation)
    method.thetas = {k: torch.randn(v.shape) for k, v in method.thetas.items()}
    new = method.new_client_model(0)
    assert set(new) == set(method.global_params)
    for key, stacked in method.thetas.items():
        assert torch.allclose(new[key], stacked.mean(0), atol=1e-6)
