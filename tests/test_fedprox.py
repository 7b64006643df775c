"""FedProx: the proximal term's gradient, its anchor (the received model) and μ = 0 as FedAvg."""

from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call

from plfl.checkpoint import load_latest_checkpoint
from plfl.experiment import run_experiment
from plfl.methods.fedprox import FedProx, FedProxConfig

from conftest import make_context, run_hook

ROOT = Path(__file__).resolve().parents[1]


def test_one_step_is_fedavgs_gradient_plus_mu_times_distance_to_the_received_model(tiny_federation):
    # Batches of 100: the whole split in one batch, one SGD step per epoch.
    context, model = make_context(tiny_federation, batch_size=100)
    received = {k: v.clone() for k, v in model.state_dict().items()}
    method = FedProx(FedProxConfig(mu=0.5), context, received)
    # Start away from the received model (as ALA's initialisation does), so that w − w^t ≠ 0.
    g = torch.Generator().manual_seed(3)
    start = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in received.items()}
    client, lr = tiny_federation.clients[1], context.federation.lr
    trained = run_hook(context, method.local_train(1, start, method.server_message(1, round_=0), round_=1)).params

    # Independently: autograd of the mean cross-entropy of the whole split at `start`.
    leaves = {n: start[n].clone().requires_grad_() for n, _ in model.named_parameters()}
    loss = F.cross_entropy(functional_call(model, leaves, (client.x_train,)), client.y_train)
    for name, grad in zip(leaves, torch.autograd.grad(loss, list(leaves.values()))):
        step = (start[name] - trained[name]) / lr  # the gradient SGD applied
        torch.testing.assert_close(step, grad + 0.5 * (start[name] - received[name]), atol=1e-5, rtol=1e-4)
        assert not torch.allclose(step, grad, atol=1e-3), name  # the proximal part is there


def metrics_and_global_model(run_dir):
    header, *rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()]
    columns = [header.index(c) for c in ("round", "accuracy", "test_loss", "train_loss")]
    final = load_latest_checkpoint(run_dir / "checkpoints")[1]["method"]["global_params"]
    return [[row[c] for c in columns] for row in rows], final


def test_zero_mu_is_fedavg_bit_for_bit(digits_config):
    rounds = {"federation.rounds": 2}
    fedavg = metrics_and_global_model(run_experiment(digits_config(**{"method.name": "fedavg"}, **rounds))[0])
    zero = metrics_and_global_model(
        run_experiment(digits_config(**{"method.name": "fedprox", "method.mu": 0}, **rounds))[0]
    )
    prox = metrics_and_global_model(
        run_experiment(digits_config(**{"method.name": "fedprox", "method.mu": 1}, **rounds))[0]
    )
    assert zero[0] == fedavg[0] and len(zero[0]) == 3  # rounds 0, 1, 2
    assert all(torch.equal(zero[1][k], v) for k, v in fedavg[1].items())
    assert prox[0][1:] != fedavg[0][1:]  # μ = 1 trains differently from round 1 on
    assert not torch.equal(prox[1]["head.weight"], fedavg[1]["head.weight"])
