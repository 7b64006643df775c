"""Class prototypes (FedProto's and FedPAC's): class means of the real samples, the server's plain mean over the
clients that hold a class, and the penalty pulling features to their class's prototype, by hand."""

import pytest
import torch
import torch.nn.functional as F

from plfl.methods.prototypes import (
    aggregate_prototypes,
    class_sums,
    local_prototypes,
    prototype_penalty,
    prototype_table,
)


def test_local_prototypes_are_the_class_means_of_the_real_samples():
    features = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    y = torch.tensor([0, 2, 0, 2])
    sums, counts = class_sums(features, y, 3, torch.tensor([1.0, 1.0, 1.0, 0.0]))  # the last sample is padding
    assert torch.equal(sums, torch.tensor([[6.0, 8.0], [0.0, 0.0], [3.0, 4.0]]))
    assert torch.equal(counts, torch.tensor([2.0, 0.0, 1.0]))
    # Two batches summed, as a step task carries them: class 2 gets (7, 8) too.
    more, more_counts = class_sums(features[3:], y[3:], 3, None)
    prototypes = local_prototypes(sums + more, counts + more_counts)
    assert list(prototypes) == ["prototype/0", "prototype/2"]  # class 1 unseen: not uploaded
    assert torch.equal(prototypes["prototype/0"], torch.tensor([3.0, 4.0]))
    assert torch.equal(prototypes["prototype/2"], torch.tensor([5.0, 6.0]))


def test_server_averages_each_class_over_the_clients_that_uploaded_it():
    uploads = [
        {"prototype/0": torch.tensor([1.0, 2.0]), "prototype/10": torch.tensor([3.0, 3.0])},
        {"prototype/0": torch.tensor([3.0, 4.0])},  # plain mean: however many samples each client has
        {"prototype/2": torch.tensor([0.0, 1.0])},
        {},
    ]
    merged = aggregate_prototypes(uploads)
    assert list(merged) == ["prototype/0", "prototype/2", "prototype/10"]
    assert torch.equal(merged["prototype/0"], torch.tensor([2.0, 3.0]))
    assert torch.equal(merged["prototype/2"], torch.tensor([0.0, 1.0]))
    assert torch.equal(merged["prototype/10"], torch.tensor([3.0, 3.0]))
    table, present = prototype_table(merged, 11, 2)
    assert table.shape == (11, 2) and present.tolist() == [1, 0, 1] + [0] * 7 + [1]
    assert torch.equal(table[10], torch.tensor([3.0, 3.0])) and not table[1].any()
    assert aggregate_prototypes([{}, {}]) == {}


def test_regulariser_value_and_gradient_by_hand():
    # F = 2, B = 3; class 1 has no global prototype. Sample 0: ‖(1, 0) − 0‖² = 1; sample 1: counts 0;
    # sample 2: ‖(2, 2) − 0‖² = 8. R = (1 + 8) / (2 · 3) = 1.5; ∂R/∂f_b = 2 p_b (f_b − C̄^{(y_b)}) / 6.
    features = torch.tensor([[1.0, 0.0], [0.0, 2.0], [2.0, 2.0]], requires_grad=True)
    y = torch.tensor([0, 1, 0])
    table, present = torch.tensor([[0.0, 0.0], [9.0, 9.0]]), torch.tensor([1.0, 0.0])
    penalty = prototype_penalty(features, y, table, present, None)
    assert penalty.item() == pytest.approx(1.5)
    (gradient,) = torch.autograd.grad(penalty, features)
    torch.testing.assert_close(gradient, torch.tensor([[1 / 3, 0.0], [0.0, 0.0], [2 / 3, 2 / 3]]))
    # PFLlib's form: MSE between the features and the features with each row replaced by its label's prototype.
    target = features.detach().clone()
    target[0], target[2] = table[0], table[0]
    assert penalty.item() == pytest.approx(F.mse_loss(features, target).item())
    # Padding does not count: the third sample masked out, R = 1 / (2 · 2).
    assert prototype_penalty(features, y, table, present, torch.tensor([1.0, 1.0, 0.0])).item() == pytest.approx(0.25)
