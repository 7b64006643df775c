"""FedAS: the alignment loss and the Fisher trace by hand, the alignment and the Fisher pass against independent
loops, no alignment giving FedPer's training bit for bit, the Fisher-weighted aggregation, what is sent both ways
(nothing to clients left out of the next round), and no method.ala."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from plfl.batches import batch_loader
from plfl.config import load_config
from plfl.errors import ConfigError, PlflWarning
from plfl.methods.base import MethodConfig, nbytes, numel
from plfl.methods.fedas import FISHER, FedAS, FedASConfig, alignment_loss, fisher_weights
from plfl.methods.fedper import FedPer
from plfl.seeding import derive_seed, sample_clients

from conftest import ROOT, make_context, run_hook, run_loop, sequential

BODY = ("body.1.weight", "body.1.bias")  # the test MLP's body parameters; its head is head.weight, head.bias


def make_method(data, federation=None, **keys):
    context, model = make_context(data, **(federation or {}))
    return FedAS(FedASConfig(**keys), context, {k: v.clone() for k, v in model.state_dict().items()}), context


def perturbed(params, seed):
    """``params`` plus noise: a client's own model that differs from the global one."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in params.items()}


def test_alignment_loss_by_hand():
    # Batch: class 0 at (1, 0), (3, 0); class 1 at (0, 2); class 2 has no prototype. F = 2.
    # Class 0 to (2, 0): (1 + 1) / (2·2) = 0.5; class 1 to (0, 0): 4 / (1·2) = 2; class 2: not counted.
    features = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [5.0, 5.0]])
    y = torch.tensor([0, 1, 0, 2])
    table = torch.tensor([[2.0, 0.0], [0.0, 0.0], [9.0, 9.0]])
    present = torch.tensor([1.0, 1.0, 0.0])
    assert alignment_loss(features, y, table, present, None).item() == pytest.approx(2.5)
    # PFLlib's form: one MSELoss per class in the batch, summed.
    expected = F.mse_loss(features[[0, 2]], table[0].expand(2, 2)) + F.mse_loss(features[[1]], table[1][None])
    torch.testing.assert_close(alignment_loss(features, y, table, present, None), expected)
    # A padded row (mask 0) counts nowhere: class 0 is then (1, 0) alone, 1 / 2.
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert alignment_loss(features, y, table, present, mask).item() == pytest.approx(0.5 + 2.0)
    assert alignment_loss(features, y, table, torch.zeros(3), None).item() == 0.0


def test_fisher_weights_normalise_the_traces():
    assert fisher_weights([1.0, 3.0]) == [0.25, 0.75]
    assert fisher_weights([0.0, 0.0]) is None and fisher_weights([float("inf"), 1.0]) is None


def test_alignment_and_fisher_pass_match_independent_loops(tiny_federation):
    client, lr, align_lr = 2, 0.1, 0.05  # client 2: 30 samples; alignment batches 8 (3 full and one of 6)
    method, context = make_method(tiny_federation, {"lr": lr}, align_batch_size=8, align_lr=align_lr, align_epochs=2)
    model, data = context.architecture, tiny_federation.clients[client]
    own = perturbed(method.initial_params, 1)
    message = method.server_message(client, 0)
    assert set(message) == set(BODY)  # the body alone
    starts = []
    executor = sequential(context)
    train = executor.train
    executor.train = lambda tasks: starts.extend(t.params for t in tasks) or train(tasks)
    result = run_hook(context, method.local_train(client, own, message, 1), executor)
    executor.train = train

    def body_of(state, x):
        return functional_call(model.body, {k.removeprefix("body."): state[k] for k in BODY}, (x,))

    with torch.no_grad():  # prototypes of the client's own model, over all its training samples
        features = body_of(own, data.x_train)
    prototypes = {c: features[data.y_train == c].mean(0) for c in data.y_train.unique().tolist()}
    body = {k: message[k].clone() for k in BODY}
    loader = batch_loader(data.x_train, data.y_train, 8, derive_seed(0, 1, client, "alignment"))
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            w = {k: t.clone().requires_grad_() for k, t in body.items()}
            z = body_of(w, x)
            loss = sum(
                F.mse_loss(z[y == c], prototypes[c].expand(int((y == c).sum()), -1)) for c in y.unique().tolist()
            )
            grads = torch.autograd.grad(loss, list(w.values()))
            body = {k: (t - align_lr * g).detach() for (k, t), g in zip(w.items(), grads)}
    (start,) = starts  # the aligned body under the client's own head
    for key in BODY:
        torch.testing.assert_close(start[key], body[key])
    for key in ("head.weight", "head.bias"):
        assert torch.equal(start[key], own[key])

    trained, trace = result.params, torch.tensor(0.0)  # Σ over batches of ‖∇ batch-mean NLL‖², all parameters
    names = [name for name, _ in model.named_parameters()]
    loader = batch_loader(data.x_train, data.y_train, 5, derive_seed(0, 1, client, "fisher"))
    for x, y in loader:
        w = {k: trained[k].clone().requires_grad_() for k in names}
        nll = -F.log_softmax(functional_call(model, w, (x,)), dim=1)[torch.arange(len(y)), y].mean()
        trace += sum(g.square().sum() for g in torch.autograd.grad(nll, list(w.values())))
    upload = method.client_message(client, result, 1)
    assert set(upload) == set(BODY) | {FISHER}
    torch.testing.assert_close(upload[FISHER], trace)
    assert all(torch.equal(upload[k], trained[k]) for k in BODY)


def test_without_alignment_a_client_trains_as_fedpers(tiny_federation):
    # align_epochs = 0: the received body under the client's own head, FedPer's model, trained the same way.
    client = 1
    method, context = make_method(tiny_federation, align_epochs=0)
    fedper = FedPer(MethodConfig(name="fedper"), context, dict(method.initial_params))
    own = perturbed(method.initial_params, 2)
    global_body = {k: v + 1.0 for k, v in method.global_params.items()}
    context.store.set(client, "model", own)
    start = fedper.pre_local_init(client, global_body, 1)
    expected = run_hook(context, fedper.local_train(client, start, global_body, 2))
    result = run_hook(context, method.local_train(client, own, global_body, 2))
    assert result.params.keys() == expected.params.keys()
    assert all(torch.equal(result.params[k], expected.params[k]) for k in expected.params)
    assert result.loss == expected.loss


def test_the_server_weights_the_bodies_by_their_fisher_traces(tiny_federation):
    method, context = make_method(tiny_federation)
    bodies = [perturbed(method.global_params, seed) for seed in (3, 4, 5)]
    messages = {i: {**b, FISHER: torch.tensor(t)} for i, b, t in zip((0, 2, 3), bodies, (1.0, 2.0, 5.0))}
    method.aggregate(messages, 1)
    for key in BODY:
        torch.testing.assert_close(
            method.global_params[key], (bodies[0][key] + 2 * bodies[1][key] + 5 * bodies[2][key]) / 8
        )
    assert set(method.global_params) == set(BODY)
    assert method.round_tables(1)["fisher"][1] == {"client": 2, "fisher": 2.0, "weight": 0.25}
    assert method.round_tables(2) == {}  # no aggregation in round 2 (yet)
    # Traces that sum to 0: the sample-size weighted mean, with a warning.
    zero = {i: {**m, FISHER: torch.tensor(0.0)} for i, m in messages.items()}
    with pytest.warns(PlflWarning, match="Fisher traces"):
        method.aggregate(zero, 2)
    sizes = [tiny_federation.clients[i].num_train for i in (0, 2, 3)]  # 10, 30, 40
    for key in BODY:
        expected = sum(n * b[key] for n, b in zip(sizes, bodies)) / sum(sizes)
        torch.testing.assert_close(method.global_params[key], expected)


def test_only_clients_of_the_next_round_receive_and_the_others_keep_their_models(tiny_federation):
    method, context = make_method(tiny_federation, {"rounds": 3, "join_ratio": 0.5})
    loop = run_loop(method, context)
    body_numel = sum(method.global_params[k].numel() for k in BODY)
    for row in (r.metrics for r in loop.history):
        sampled = sample_clients(0, row["round"] + 1, 4, 0.5)
        assert row["params_sent"] == len(sampled) * body_numel
        assert row["bytes_sent"] == len(sampled) * body_numel * 4
        for i in range(4):
            assert (method.server_message(i, row["round"]) is None) == (i not in sampled)
        if row["round"] > 0:  # two uploads of the body and one Fisher trace each
            assert row["params_received"] == 2 * (body_numel + 1)
            assert row["bytes_received"] == 2 * (body_numel + 1) * 4
    assert [len(r.tables["fisher"]) for r in loop.history[1:]] == [2, 2, 2]
    # A client keeps its own model through the broadcast: what it holds is what it trained or the initial model.
    message = method.server_message(0, 3)
    for i in range(4):
        stored = context.store.get(i, "model")
        kept = method.pre_local_init(i, message, 3)
        assert all(torch.equal(kept[k], stored[k]) for k in stored)
    trained = {i for r in (1, 2, 3) for i in sample_clients(0, r, 4, 0.5)}
    for i in set(range(4)) - trained:
        assert all(torch.equal(context.store.get(i, "model")[k], v) for k, v in method.initial_params.items())
    assert numel(message) in (0, body_numel) and nbytes(method.new_client_model(3)) == nbytes(method.initial_params)


def test_fedas_has_no_ala():
    # Its alignment is a client's local initialisation: ALA (FedALA's Table 4) has no place here.
    with pytest.raises(ConfigError, match="Unknown config key 'method.ala'"):
        load_config(ROOT / "configs" / "fedas.yaml", ["method.ala.s=50"])


def test_bad_alignment_keys_are_refused():
    with pytest.raises(ConfigError, match="method.align_batch_size"):
        load_config(ROOT / "configs" / "fedas.yaml", ["method.align_batch_size=0"])
    with pytest.raises(ConfigError, match="method.align_lr"):
        load_config(ROOT / "configs" / "fedas.yaml", ["method.align_lr=-1"])
