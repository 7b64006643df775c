"""FedPAC: the QP on hand-solvable instances, the feature statistics and the alignment term by hand, the body
epochs against an independent loop, what is sent both ways, and heads kept per client (no method.ala)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from plfl.batches import batch_loader
from plfl.config import load_config
from plfl.errors import ConfigError
from plfl.methods.base import nbytes
from plfl.methods.fedpac import (
    FedPAC,
    FedPACConfig,
    combination_matrix,
    combination_weights,
    combine_heads,
    feature_statistics,
    simplex_qp,
)
from plfl.methods.prototypes import aggregate_prototypes, class_sums, local_prototypes
from plfl.seeding import derive_seed

from conftest import ROOT, make_context, run_hook, run_loop, sequential


def make_method(data, federation=None, **keys):
    context, model = make_context(data, **(federation or {}))
    return FedPAC(FedPACConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def test_qp_matches_the_two_client_optimum():
    # min a²·P00 + 2a(1−a)·P01 + (1−a)²·P11 on [0, 1]: a = (P11 − P01) / (P00 + P11 − 2 P01), clipped.
    np.testing.assert_allclose(simplex_qp(np.array([[1.0, 0.0], [0.0, 3.0]])), [0.75, 0.25], atol=1e-6)
    np.testing.assert_allclose(simplex_qp(np.array([[2.0, 1.0], [1.0, 4.0]])), [0.75, 0.25], atol=1e-6)
    np.testing.assert_allclose(simplex_qp(np.array([[1.0, 2.0], [2.0, 4.0]])), [1.0, 0.0], atol=1e-6)  # a = 2 → 1
    # Scale-free: the same weights for P·10⁻⁶ and P·10⁶.
    for scale in (1e-6, 1e6):
        np.testing.assert_allclose(simplex_qp(scale * np.array([[1.0, 0.0], [0.0, 3.0]])), [0.75, 0.25], atol=1e-6)


def test_qp_weights_satisfy_the_optimality_conditions():
    # KKT on the simplex: the gradient 2Pα is equal on the support and no smaller off it.
    g = torch.Generator().manual_seed(1)
    a = torch.randn(6, 4, generator=g, dtype=torch.float64)
    p = (a @ a.T + torch.diag(torch.rand(6, generator=g, dtype=torch.float64))).numpy()
    alpha = simplex_qp(p)
    assert alpha.sum() == pytest.approx(1.0, abs=1e-9) and (alpha >= 0).all()
    gradient = 2 * p @ alpha
    support = alpha > 1e-6
    assert np.ptp(gradient[support]) < 1e-5
    assert (gradient[~support] >= gradient[support].min() - 1e-5).all()


def test_combination_matrix_and_weights_by_hand():
    # Client 0's P: diag(v) + gaps·gapsᵀ, gaps = h_0 − h_j: 0 for j = 0, (−1, 0, 1, −2) flattened for j = 1.
    variances = torch.tensor([1.0, 2.0])
    means = torch.tensor([[[1.0, 0.0], [1.0, -1.0]], [[2.0, 0.0], [0.0, 1.0]]])  # (2 clients, 2 classes, F = 2)
    np.testing.assert_allclose(combination_matrix(variances, means, 0), [[1.0, 0.0], [0.0, 8.0]])
    np.testing.assert_allclose(combination_matrix(variances, means, 1), [[7.0, 0.0], [0.0, 2.0]])
    alpha0, alpha1 = combination_weights(variances, means)
    torch.testing.assert_close(alpha0, torch.tensor([8 / 9, 1 / 9], dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(alpha1, torch.tensor([2 / 9, 7 / 9], dtype=torch.float64), atol=1e-6, rtol=0)
    # A weight below 10⁻³ is set to 0 and the rest is not renormalised: P = diag(1, 2000) → (2000, 1)/2001.
    (alpha,) = combination_weights(torch.tensor([1.0]), torch.zeros(1, 1, 1))
    assert alpha.tolist() == [1.0]
    alpha, _ = combination_weights(torch.tensor([1.0, 2000.0]), torch.zeros(2, 1, 1))
    assert alpha[1] == 0 and alpha[0] == pytest.approx(2000 / 2001, abs=1e-6)
    heads = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, -2.0])}]
    torch.testing.assert_close(combine_heads(heads, torch.tensor([0.25, 0.75]))["w"], torch.tensor([2.5, -1.0]))


def test_feature_statistics_by_hand():
    # Class 0: (1, 0), (3, 0); class 1: (0, 2); class 2: none. m = 3.
    # h = ((4, 0), (0, 2), (0, 0)) / 3. V = Σ_k p_k E‖z‖²|k − p_k² ‖μ_k‖² = (2/3·5 − 4/9·4) + (1/3·4 − 1/9·4) = 22/9.
    features = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]])
    y = torch.tensor([0, 1, 0])
    variance, h = feature_statistics(features, y, 3)
    torch.testing.assert_close(h, torch.tensor([[4 / 3, 0.0], [0.0, 2 / 3], [0.0, 0.0]]))
    torch.testing.assert_close(variance, torch.tensor(22 / 27))  # V/m
    prototypes = local_prototypes(*class_sums(features, y, 3))
    assert set(prototypes) == {"prototype/0", "prototype/1"}
    torch.testing.assert_close(prototypes["prototype/0"], torch.tensor([2.0, 0.0]))
    merged = aggregate_prototypes([prototypes, {"prototype/0": torch.tensor([4.0, 2.0])}])
    torch.testing.assert_close(merged["prototype/0"], torch.tensor([3.0, 1.0]))  # the plain mean over clients
    torch.testing.assert_close(merged["prototype/1"], torch.tensor([0.0, 2.0]))


def test_body_epochs_match_an_independent_loop_and_the_head_stays_frozen(tiny_federation):
    lam, lr, client = 2.0, 0.1, 1  # client 1: 20 samples, 4 batches of 5, 2 epochs
    method, context = make_method(tiny_federation, {"local_epochs": 2, "lr": lr}, lam=lam)
    start = method.pre_local_init(client, method.server_message(client, 0), 0)
    g = torch.Generator().manual_seed(3)
    prototypes = {"prototype/0": torch.randn(16, generator=g), "prototype/2": torch.randn(16, generator=g)}
    message = {**method.server_message(client, 0), **prototypes}
    executor, heads = sequential(context), []
    train = executor.train
    executor.train = lambda tasks: heads.extend(results := train(tasks)) or results
    result = run_hook(context, method.local_train(client, start, message, 1), executor)
    executor.train = train
    (head,) = heads
    for key, value in start.items():  # the head epoch moved the head alone; the body epochs kept it
        assert torch.equal(head.params[key], value) != key.startswith("head."), key
        assert torch.equal(result.params[key], head.params[key]) == key.startswith("head."), key

    data, model = tiny_federation.clients[client], context.architecture
    state = {k: v.clone() for k, v in head.params.items()}
    table = torch.zeros(3, 16)
    table[0], table[2] = prototypes["prototype/0"], prototypes["prototype/2"]
    loader = batch_loader(data.x_train, data.y_train, 5, derive_seed(0, 1, client, "local_training"))
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            body = {k: t.requires_grad_() for k, t in state.items() if k.startswith("body.")}
            features = functional_call(model.body, {k.removeprefix("body."): t for k, t in body.items()}, (x,))
            logits = features @ state["head.weight"].T + state["head.bias"]
            present = (y == 0) | (y == 2)
            penalty = ((features - table[y]).square().sum(1) * present).sum() / (len(y) * 16)
            grads = torch.autograd.grad(F.cross_entropy(logits, y) + lam * penalty, list(body.values()))
            with torch.no_grad():
                state.update({k: t - lr * g for (k, t), g in zip(body.items(), grads)})
    for key in start:
        torch.testing.assert_close(result.params[key], state[key])
    assert result.samples_seen == 3 * data.num_train  # one head epoch, two body epochs


def test_what_is_sent_both_ways_and_heads_stay_with_their_clients(tiny_federation):
    method, context = make_method(tiny_federation)
    initial = {k: v.clone() for k, v in context.architecture.state_dict().items()}
    body_keys = {k for k in initial if k.startswith("body.")}
    head_keys = {"head.weight", "head.bias"}
    first = method.server_message(0, 0)
    assert set(first) == body_keys  # no head and no prototype before the first aggregation
    for i in range(4):
        context.store.set(i, "model", method.pre_local_init(i, method.server_message(i, 0), 0))

    results, messages = {}, {}
    for i in (0, 1):
        results[i] = run_hook(context, method.local_train(i, context.store.get(i, "model"), first, 1))
        context.store.set(i, "model", results[i].params)  # as the loop stores it
        messages[i] = method.client_message(i, results[i], 1)
    data, model = tiny_federation.clients[0], context.architecture
    classes = sorted(set(data.y_train.tolist()))
    assert set(messages[0]) == body_keys | head_keys | {f"prototype/{k}" for k in classes} | {
        "fedpac/variance",
        "fedpac/h",
    }
    with torch.no_grad():  # the statistics are the received body's, the prototypes the trained body's
        model.load_state_dict(initial)
        variance, h = feature_statistics(model.body(data.x_train), data.y_train, 3)
        model.load_state_dict(results[0].params)
        trained = model.body(data.x_train)
    torch.testing.assert_close(messages[0]["fedpac/variance"], variance)
    torch.testing.assert_close(messages[0]["fedpac/h"], h)
    torch.testing.assert_close(messages[0][f"prototype/{classes[0]}"], trained[data.y_train == classes[0]].mean(0))

    method.aggregate(messages, 1)
    n0, n1 = tiny_federation.clients[0].num_train, tiny_federation.clients[1].num_train
    for key in body_keys:
        expected = (n0 * messages[0][key] + n1 * messages[1][key]) / (n0 + n1)
        torch.testing.assert_close(method.global_params[key], expected)
    prototypes = {k for m in messages.values() for k in m if k.startswith("prototype/")}
    weights = combination_weights(
        torch.stack([messages[i]["fedpac/variance"] for i in (0, 1)]),
        torch.stack([messages[i]["fedpac/h"] for i in (0, 1)]),
    )
    sent, unsampled = method.server_message(0, 1), method.server_message(2, 1)
    assert set(sent) == body_keys | head_keys | prototypes and set(unsampled) == body_keys | prototypes
    assert nbytes(sent) - nbytes(unsampled) == sum(initial[k].numel() * 4 for k in head_keys)
    combined = combine_heads([{k: messages[i][k] for k in head_keys} for i in (0, 1)], weights[0])
    own = method.pre_local_init(0, sent, 1)  # the global body under its combined head
    kept = method.pre_local_init(2, unsampled, 1)  # never trained: the initial head
    assert list(own) == list(kept) == list(initial)
    for key in initial:
        if key in head_keys:
            torch.testing.assert_close(own[key], combined[key])
            assert torch.equal(kept[key], initial[key])
        else:
            assert torch.equal(own[key], method.global_params[key]) and torch.equal(kept[key], own[key])
    assert method.round_tables(1)["head_weights"][0] == {
        "client": 0,
        "w0": weights[0][0].item(),
        "w1": weights[0][1].item(),
        "w2": 0.0,
        "w3": 0.0,
    }


def test_a_few_rounds_run_and_every_sampled_client_gets_its_combined_head(tiny_federation):
    method, context = make_method(tiny_federation, {"rounds": 3, "join_ratio": 0.5})
    loop = run_loop(method, context)
    assert [r.round for r in loop.history] == [0, 1, 2, 3]
    assert all(r.metrics["accuracy"] == r.metrics["accuracy"] for r in loop.history)  # no NaN
    rows = loop.history[-1].tables["head_weights"]
    assert len(rows) == 2 and set(method.combined_heads) == {row["client"] for row in rows}
    for row in rows:
        assert 0.99 <= sum(v for k, v in row.items() if k.startswith("w")) <= 1 + 1e-9
    for client_id, head in method.combined_heads.items():
        stored = context.store.get(client_id, "model")
        assert all(torch.equal(stored[k], v) for k, v in head.items())
    assert set(method.state_dict()) == {"global_params", "prototypes", "combined_heads"}


def test_fedpac_has_no_ala():
    # Its own head is a client's local initialisation: ALA (FedALA's Table 4) has nothing to aggregate into.
    with pytest.raises(ConfigError, match="Unknown config key 'method.ala'"):
        load_config(ROOT / "configs" / "fedpac.yaml", ["method.ala.s=50"])


def test_momentum_is_refused(tiny_federation):
    with pytest.raises(ConfigError, match="federation.momentum"):
        make_method(tiny_federation, {"momentum": 0.5})
