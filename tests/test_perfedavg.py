"""Per-FedAvg: the FO and HF meta-gradients, PFLlib's batches, the one-step adapted evaluated model."""

import copy

import pytest
import torch
import torch.nn.functional as F

from plfl.batches import batch_loader
from plfl.experiment import run_experiment
from plfl.methods.perfedavg import PerFedAvg, PerFedAvgConfig, hessian_vector_product, meta_gradient
from plfl.seeding import derive_seed
from plfl.tasks import Batch

from conftest import make_context, run_hook


def squared_error(params, buffers, batch):
    """f(w; D) = 1/(2n) ‖Xw − y‖²: ∇f = Xᵀ(Xw − y)/n, ∇²f = XᵀX/n (no buffers: they pass through)."""
    return 0.5 * ((batch.x @ params["w"] - batch.y) ** 2).mean(), buffers


# D: x = (1, 0), y = 0; D′: x = (1, 1), y = 2; D″: x = (0, 2), y = anything.
D, D1, D2 = [
    Batch(torch.tensor([x]), torch.tensor([y]), None)
    for x, y in (([1.0, 0.0], 0.0), ([1.0, 1.0], 2.0), ([0.0, 2.0], 5.0))
]
W = {"w": torch.tensor([1.0, 0.0])}


def test_fo_meta_gradient_matches_hand_computation():
    # ∇f(w; D) = (1, 0)·1, w̃ = w − 0.5 (1, 0) = (0.5, 0); ∇f(w̃; D′) = (1, 1)(0.5 − 2) = (−1.5, −1.5).
    g, value, _ = meta_gradient(squared_error, W, {}, [D, D1], alpha=0.5)
    torch.testing.assert_close(g["w"], torch.tensor([-1.5, -1.5]))
    assert value.item() == pytest.approx(0.5)  # f(w; D) = ½ · 1²


def test_hf_meta_gradient_matches_hand_computation():
    # ∇²f(w; D″) = (0, 2)ᵀ(0, 2) = diag(0, 4); (I − 0.5 ∇²f)(−1.5, −1.5) = (−1.5, −1.5 + 3).
    g, _, _ = meta_gradient(squared_error, W, {}, [D, D1, D2], alpha=0.5)
    torch.testing.assert_close(g["w"], torch.tensor([-1.5, 1.5]))


def test_hessian_vector_product_equals_full_hessian_times_vector():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))

    def loss(p, buffers, batch):
        return F.cross_entropy(torch.func.functional_call(model, p, (batch.x,)), batch.y), buffers

    vector = {k: torch.randn_like(v) for k, v in params.items()}
    shapes, sizes = [v.shape for v in params.values()], [v.numel() for v in params.values()]

    def flat_loss(theta):
        return loss({k: t.view(s) for k, t, s in zip(params, theta.split(sizes), shapes)}, {}, Batch(x, y, None))[0]

    hessian = torch.autograd.functional.hessian(flat_loss, torch.cat([v.flatten() for v in params.values()]))
    expected = hessian @ torch.cat([v.flatten() for v in vector.values()])
    product, _ = hessian_vector_product(loss, params, {}, vector, Batch(x, y, None))
    torch.testing.assert_close(torch.cat([v.flatten() for v in product.values()]), expected)
    assert expected.abs().max() > 1e-3  # a non-trivial curvature was checked


def make_method(data, **keys):
    context, model = make_context(data, batch_size=10, lr=0.1)
    return PerFedAvg(PerFedAvgConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), model


def sgd_step(model, x, y, lr):
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad


def test_local_train_is_pfllibs_fo_step_from_the_received_model(tiny_federation):
    # Client 1 holds 20 samples = one loader batch of 2B: one step on D = its first B samples, D′ the rest.
    method, model = make_method(tiny_federation, alpha=0.3, beta=0.2)
    client = tiny_federation.clients[1]
    x, y = next(iter(batch_loader(client.x_train, client.y_train, 20, derive_seed(0, 1, 1, "local_training"))))
    # PFLlib's clientperavg.train: a step of α on D, the gradient on D′ at w̃, applied with β at w.
    reference = copy.deepcopy(model)
    reference.load_state_dict(method.global_params)
    sgd_step(reference, x[:10], y[:10], 0.3)
    reference.zero_grad()
    F.cross_entropy(reference(x[10:]), y[10:]).backward()
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(method.global_params[name] - 0.2 * p.grad)
    adapted = run_hook(method.context, method.pre_local_init(1, method.global_params, 1))  # not where training starts
    result = run_hook(method.context, method.local_train(1, adapted, method.global_params, 1))
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(result.params[name], value)
    assert result.samples_seen == 20


def test_hf_takes_one_step_per_three_batches_and_drops_the_short_rest(tiny_federation):
    method, _ = make_method(tiny_federation, variant="hf")

    def train(client: int):
        return run_hook(method.context, method.local_train(client, method.global_params, method.global_params, 1))

    assert train(3).samples_seen == 30  # 40 = 30 + 10, 10 dropped
    assert train(2).samples_seen == 30  # one full batch of 3B


def test_evaluated_model_is_the_global_after_one_step_of_alpha(tiny_federation):
    method, model = make_method(tiny_federation, alpha=0.5)
    client = tiny_federation.clients[2]
    x, y = next(iter(batch_loader(client.x_train, client.y_train, 10, derive_seed(0, 4, 2, "adaptation"))))
    reference = copy.deepcopy(model)
    reference.load_state_dict(method.global_params)
    sgd_step(reference, x, y, 0.5)
    adapted = run_hook(method.context, method.pre_local_init(2, method.global_params, 4))
    assert list(adapted) == list(method.global_params)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(adapted[name], value)
    assert not torch.equal(adapted["head.weight"], method.global_params["head.weight"])


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_perfedavg_learns_digits(digits_config, variant):
    run_dir, summary = run_experiment(
        digits_config(
            **{"method.name": "perfedavg", "method.variant": variant, "federation.rounds": 2, "federation.lr": 0.2}
        )
    )
    header, *rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
    accuracy = [float(row[header.index("accuracy")]) for row in rows]
    # Measured 0.28 → 0.44 (fo) and 0.41 (hf); 10 classes: chance is 0.1.
    assert accuracy[-1] > accuracy[0] + 0.05 and accuracy[-1] > 0.3
    assert summary["status"] == "completed"
