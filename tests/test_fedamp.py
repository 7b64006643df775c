"""FedAMP: the attention weights ξ and cloud models by hand, the client's proximal pull towards u_i,
and an end-to-end run."""

import math

import torch
import torch.nn.functional as F
from torch.func import functional_call

from plfl.checkpoint import load_latest_checkpoint
from plfl.experiment import run_experiment
from plfl.methods.base import nbytes
from plfl.methods.fedamp import FedAMP, FedAMPConfig, attention_weights, cloud_model

from conftest import last_metrics, make_context, run_hook


def test_identical_clients_get_equal_cloud_models_and_a_dissimilar_one_is_down_weighted():
    # w_0 = w_1 = (0, 0), w_2 = (1, 1): ‖w_0 − w_2‖² = 2. α = 0.5, σ = 2:
    # ξ_01 = 0.5 e^0 / 2 = 0.25, ξ_02 = 0.5 e^{-1} / 2 = 0.25/e, ξ_00 = 1 − 0.25 − 0.25/e.
    models = {"w": torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]), "b": torch.zeros(3, 1)}
    xi = attention_weights(models, alpha=0.5, sigma=2.0)
    e = math.exp(-1)
    expected = torch.tensor(
        [[0.75 - 0.25 * e, 0.25, 0.25 * e], [0.25, 0.75 - 0.25 * e, 0.25 * e], [0.25 * e, 0.25 * e, 1 - 0.5 * e]]
    )
    torch.testing.assert_close(xi, expected)
    assert xi[0, 2] < xi[0, 1]  # the dissimilar client weighs less
    u = [cloud_model(xi[i], i, models) for i in range(3)]
    assert torch.equal(u[0]["w"], u[1]["w"])
    torch.testing.assert_close(u[0]["w"], torch.full((2,), 0.25 * e))  # Σ_j ξ_0j w_j
    torch.testing.assert_close(u[2]["w"], torch.full((2,), 1 - 0.5 * e))
    same = {"w": torch.ones(3, 4) / 3}  # identical models: u_i = w_i bit for bit (here ξ_00 = 1 − 2 = −1)
    assert torch.equal(cloud_model(attention_weights(same, 1.0, 1.0)[0], 0, same)["w"], same["w"][0])


def test_client_trains_its_own_model_pulled_towards_the_cloud_model(tiny_federation):
    # Batches of 100: the whole split in one batch, one SGD step per epoch.
    context, model = make_context(tiny_federation, batch_size=100)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    method = FedAMP(FedAMPConfig(alpha_k=0.25, lam=0.5), context, initial)
    method.models = {k: torch.stack([initial[k] + 0.1 * j for j in range(4)]) for k in method.models}  # w_j
    method.xi = torch.tensor([[0.0] * 4, [0.5, 0.2, 0.3, 0.0], [0.0] * 4, [0.0] * 4])
    cloud = {k: initial[k] + 0.1 + 0.5 * -0.1 + 0.3 * 0.1 for k in initial}  # u_1 = w_1 + Σ ξ_1j (w_j − w_1)
    message = method.server_message(1, round_=0)
    for key, value in message.items():
        torch.testing.assert_close(value, cloud[key])
    g = torch.Generator().manual_seed(3)
    own = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in initial.items()}
    trained = run_hook(context, method.local_train(1, own, message, round_=1)).params

    # Independently: one SGD step from the client's own model on CE + λ/(2α_K)‖w − u_1‖², μ = 0.5 / 0.25 = 2.
    client, lr = tiny_federation.clients[1], context.federation.lr
    leaves = {n: own[n].clone().requires_grad_() for n, _ in model.named_parameters()}
    loss = F.cross_entropy(functional_call(model, leaves, (client.x_train,)), client.y_train)
    for name, grad in zip(leaves, torch.autograd.grad(loss, list(leaves.values()))):
        step = (own[name] - trained[name]) / lr
        torch.testing.assert_close(step, grad + 2.0 * (own[name] - cloud[name]), atol=1e-5, rtol=1e-4)


def test_fedamp_runs_end_to_end_sending_one_cloud_model_per_client(digits_config):
    run_dir, _ = run_experiment(digits_config(**{"method.name": "fedamp"}))
    last = last_metrics(run_dir)
    assert float(last["accuracy"]) > 0.3  # 10 classes: chance is 0.1
    model = load_latest_checkpoint(run_dir / "checkpoints")[1]["method"]["global_params"]  # the MLP: no buffers
    assert float(last["bytes_sent"]) == 5 * nbytes(model) == float(last["bytes_received"])
    assert float(last["self_weight_min"]) <= float(last["self_weight_mean"]) <= 1
