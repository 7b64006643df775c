"""Gradient inversion (``plfl invert``): one client's training batch reconstructed from its upload of one round.

With one local step (``federation.local_steps=1``) of plain SGD (``federation.momentum=0``) at learning rate η on a
batch of B samples, the client's upload θ_up and the model it received θ_sent give the batch's gradient exactly:
g = (θ_sent − θ_up) / η (:func:`observed_gradient`), over the model's parameters, g the gradient of the batch-mean
cross-entropy at θ_sent. The server knows θ_sent and the architecture; the attacks look for a batch whose gradient
at θ_sent is g:

- DLG (Zhu et al., *Deep Leakage from Gradients*, NeurIPS 2019, arXiv:1906.08935, Alg. 1 and Eq. 4): dummy inputs
  x' (B, C, H, W) and dummy label logits y' (B, K) from N(0, 1), optimised by L-BFGS to minimise
  ‖∇_θ ℓ(θ_sent; x', softmax(y')) − g‖² summed over every parameter (:func:`dlg`);
- iDLG (Zhao et al., *iDLG: Improved Deep Leakage from Gradients*, 2020, arXiv:2001.02610, Sec. 3.1): for B = 1,
  the gradient of the cross-entropy by the last layer's weights W (K, d) is (p − e_y) hᵀ, h ≥ 0 after a ReLU, so
  the row of the true class y alone is ≤ 0: y = argmin_k Σ_j ∂ℓ/∂W_kj (:func:`idlg_label`); only x' is optimised.

The reconstructions are compared with the true batch, which plfl's one batch order gives (:mod:`plfl.batches`), in
the data's pixel range (:func:`unit_range`): PSNR and SSIM per image (torchmetrics), after pairing each true image
with a reconstruction by the assignment of highest total PSNR (:func:`matched`), and the recovered labels' accuracy.

What is observed comes from one function (:func:`observed_gradient`) of what the client sent, so a run with DP in its
local training is attacked through the same path as one without. The upload of a run with ``privacy.level=client``
is the client's raw model (the server clips and noises the mean of the uploads, not the upload itself).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.func import functional_call
from torchmetrics.image import PeakSignalNoiseRatio, StructuralSimilarityIndexMeasure

from plfl.batches import has_batch_norm, last_batch_minimum, training_rows
from plfl.callbacks.base import FederationCallback, RunInfo
from plfl.checkpoint import checkpoint_path, read_checkpoint
from plfl.data import FederatedData, load_federated_data
from plfl.errors import ConfigError, FederationError, PlflWarning
from plfl.experiment import hold_out, run_experiment
from plfl.methods import method_class
from plfl.models import models
from plfl.seeding import derive_seed, sample_clients, unseen_clients
from plfl.state import Params
from plfl.tasks import TrainResult

ATTACKS = ("dlg", "idlg")
# The relative error ‖g − ∇ℓ(true batch)‖ / ‖∇ℓ(true batch)‖ above which, without noise, g is not that batch's
# gradient: float32 rounding leaves about 1e-6.
GRADIENT_TOLERANCE = 1e-3
# The pixel range each source's images are stored in (plfl.data.loading); the others are normalised per channel
# with statistics not kept, and are taken over the client's training images (unit_range).
PIXEL_RANGES = {"digits": (0.0, 1.0), "leaf": (0.0, 1.0), "pfllib": (-1.0, 1.0)}
TORCHVISION_RANGE = (-1.0, 1.0)


def observed_gradient(sent: Params, uploaded: Params, lr: float, names: list[str]) -> Params:
    """g = (θ_sent − θ_up) / η for each parameter in ``names``: after one plain SGD step at learning rate η = ``lr``
    from ``sent``, the gradient of the step's batch-mean loss, float64, shaped like the parameters.

    Raises:
        KeyError: a parameter missing from ``sent`` or ``uploaded``.
    """
    return {k: (sent[k].double() - uploaded[k].double()) / lr for k in names}


def batch_gradient(
    model: nn.Module, state: Params, x: torch.Tensor, y: torch.Tensor, create_graph: bool = False
) -> Params:
    """∇_θ ℓ at θ = ``state`` (state_dict names → tensors) of ``model``'s batch-mean cross-entropy ℓ on inputs ``x``
    (B, *input_shape) with targets ``y``: (B,) int64 classes or (B, K) probabilities. One tensor per parameter, in the
    model's order; with ``create_graph`` differentiable by ``x`` and ``y`` (the attacks' objective)."""
    names = [name for name, _ in model.named_parameters()]
    params = {k: state[k].detach().requires_grad_() for k in names}
    buffers = {k: v.clone() for k, v in state.items() if k not in params}  # BatchNorm's statistics move in place
    loss = F.cross_entropy(functional_call(model, {**buffers, **params}, (x,)), y)
    return dict(zip(names, torch.autograd.grad(loss, list(params.values()), create_graph=create_graph)))


def last_layer_weight(model: nn.Module, num_classes: int) -> str:
    """The name of ``model``'s last (num_classes, d) weight: the classifier whose gradient gives iDLG's label.

    Raises:
        ValueError: no such parameter.
    """
    names = [k for k, p in model.named_parameters() if p.dim() == 2 and p.shape[0] == num_classes]
    if not names:
        raise ValueError(f"{type(model).__name__} has no linear classifier weight of {num_classes} rows for iDLG")
    return names[-1]


def idlg_label(gradient: torch.Tensor) -> int:
    """The label of a batch of one from its last-layer weight gradient (K, d): argmin_k Σ_j ∂ℓ/∂W_kj, the one row
    of (p − e_y) hᵀ that is ≤ 0 (Zhao et al., 2020, Sec. 3.1; needs h ≥ 0, e.g. after a ReLU)."""
    return int(gradient.sum(dim=1).argmin())


@dataclass
class Reconstruction:
    """What an attack returns: ``x`` (B, *input_shape) float64, ``labels`` (B,) int64, and the final gradient
    ``distance`` Σ‖∇_θ ℓ(x') − g‖²."""

    x: torch.Tensor
    labels: torch.Tensor
    distance: float


def dlg(
    model: nn.Module,
    state: Params,
    gradient: Params,
    input_shape: tuple[int, ...],
    num_classes: int,
    batch_size: int,
    iterations: int,
    seed: int,
    labels: Optional[torch.Tensor] = None,
    restarts: int = 1,
) -> Reconstruction:
    """DLG (Zhu et al., NeurIPS 2019, Alg. 1): ``batch_size`` dummy inputs and label logits drawn from N(0, 1)
    (a generator seeded ``seed``), optimised together by L-BFGS (``iterations`` iterations at step 1 without a line
    search, as the paper's code) to minimise Σ_k ‖∇_θ ℓ(``state``; x', softmax(y'))_k − ``gradient``_k‖² over the
    parameters k (Eq. 4); labels: argmax of y'. With ``labels`` (B,) given (iDLG), y' is not used and only x' is
    optimised. Runs in float64 on the CPU.

    Departure: ``restarts`` draws, each optimised, the one of smallest gradient distance kept (as Geiping et al.,
    NeurIPS 2020, restart). The paper's networks use sigmoids; with ReLUs (plfl's models) a hidden unit that is
    off for x' and on for the true input passes no gradient to x', and a draw can stop far from the batch.
    """
    generator = torch.Generator().manual_seed(seed)
    state = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
    gradient = {k: v.double() for k, v in gradient.items()}
    best: Optional[Reconstruction] = None
    for _ in range(restarts):
        x = torch.randn((batch_size, *input_shape), generator=generator, dtype=torch.float64)
        logits = torch.randn((batch_size, num_classes), generator=generator, dtype=torch.float64)
        result = descend(model, state, gradient, x, logits if labels is None else labels, iterations)
        if best is None or result.distance < best.distance:
            best = result
    return best


def descend(
    model: nn.Module, state: Params, gradient: Params, x: torch.Tensor, y: torch.Tensor, iterations: int
) -> Reconstruction:
    """One draw of :func:`dlg`: L-BFGS from the dummy inputs ``x`` (B, *input_shape) and either label logits ``y``
    (B, K) float, optimised with ``x``, or fixed labels ``y`` (B,) int64."""
    x = x.clone().requires_grad_()
    soft = y.is_floating_point()
    y = y.clone().requires_grad_() if soft else y
    optimizer = torch.optim.LBFGS(
        [x, y] if soft else [x], lr=1, max_iter=iterations, tolerance_grad=0, tolerance_change=0
    )

    def distance(create_graph: bool) -> torch.Tensor:
        dummy = batch_gradient(model, state, x, y.softmax(dim=1) if soft else y, create_graph=create_graph)
        return sum((dummy[k] - g).square().sum() for k, g in gradient.items())

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = distance(create_graph=True)
        loss.backward()
        return loss

    optimizer.step(closure)
    labels = y.detach().argmax(dim=1) if soft else y
    return Reconstruction(x.detach(), labels, float(distance(create_graph=False)))


def idlg(
    model: nn.Module,
    state: Params,
    gradient: Params,
    input_shape: tuple[int, ...],
    num_classes: int,
    iterations: int,
    seed: int,
    restarts: int = 1,
) -> Reconstruction:
    """iDLG (Zhao et al., 2020) on a batch of one: the label from :func:`idlg_label` of the last layer's weight
    gradient, then :func:`dlg` on the input alone (``restarts`` draws).

    Raises:
        ValueError: the model has no linear classifier (:func:`last_layer_weight`).
    """
    label = idlg_label(gradient[last_layer_weight(model, num_classes)])
    labels = torch.tensor([label])
    return dlg(model, state, gradient, input_shape, num_classes, 1, iterations, seed, labels, restarts)


def unit_range(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Images stored in [``low``, ``high``] mapped to [0, 1], clamped there (a reconstruction may overshoot)."""
    return ((x - low) / (high - low)).clamp(0, 1)


def psnr(true: torch.Tensor, recon: torch.Tensor) -> torch.Tensor:
    """(B,) PSNR in dB of each image of ``recon`` against the same image of ``true`` (B, C, H, W), both in [0, 1]:
    10 log₁₀(1 / MSE) (torchmetrics' ``PeakSignalNoiseRatio``, data range 1)."""
    metric = PeakSignalNoiseRatio(data_range=1.0, reduction="none", dim=(1, 2, 3))
    return metric(recon.float(), true.float()).reshape(len(true))  # torchmetrics squeezes a batch of one


def ssim(true: torch.Tensor, recon: torch.Tensor) -> torch.Tensor:
    """(B,) SSIM (Wang et al., IEEE TIP 2004) of each image of ``recon`` against the same image of ``true``
    (B, C, H, W), both in [0, 1] (torchmetrics' ``StructuralSimilarityIndexMeasure``, data range 1): its Gaussian
    window (σ = 1.5, 11 × 11) where the images hold it; smaller images (digits: 8 × 8) a uniform window of the
    largest odd size that fits."""
    side = min(true.shape[-2:])
    options: dict[str, Any] = {} if side >= 11 else {"gaussian_kernel": False, "kernel_size": side - 1 + side % 2}
    metric = StructuralSimilarityIndexMeasure(data_range=1.0, reduction="none", **options)
    return metric(recon.float(), true.float()).reshape(len(true))


def matched(true: torch.Tensor, recon: torch.Tensor) -> torch.Tensor:
    """(B,) int64: for each true image (B, C, H, W), the index of its reconstruction in ``recon`` under the
    one-to-one assignment of highest total :func:`psnr` (scipy's ``linear_sum_assignment``): DLG recovers a batch
    in no particular order."""
    b = len(true)
    pairs = psnr(true.repeat_interleave(b, dim=0), recon.repeat(b, *[1] * (recon.dim() - 1))).view(b, b)
    _, columns = linear_sum_assignment(pairs.numpy(), maximize=True)
    return torch.as_tensor(columns, dtype=torch.long)


class UploadRecorder(FederationCallback):
    """Keeps the trained model of client ``client`` in round ``round_`` (what :meth:`Method.client_message`
    uploads by default: ``result.upload`` if set, else ``result.params``)."""

    def __init__(self, client: int, round_: int):
        self.client, self.round = client, round_
        self.upload: Optional[Params] = None

    def on_client_end(self, run: RunInfo, round_: int, client_id: int, result: TrainResult) -> None:
        if (round_, client_id) == (self.round, self.client):
            self.upload = result.params if result.upload is None else result.upload


def participants(data: FederatedData, cfg: DictConfig) -> FederatedData:
    """``data`` without the unseen clients (``federation.unseen_clients``): the clients as the run numbers them."""
    return hold_out(data, unseen_clients(cfg.federation.seed, len(data.clients), cfg.federation.unseen_clients))[0]


def check_inversion(cfg: DictConfig, data: FederatedData, client: int, round_: int, attack: str) -> None:
    """Refuse what the attack cannot observe as one gradient, before a run starts.

    Raises:
        ConfigError: not images; a method whose upload is not a model; ``federation.local_steps`` not 1;
            momentum; augmentation or a poisoning attack (the batch is not the stored samples); ``round_`` not in
            1..``federation.rounds`` or ``client`` not a participant sampled in it; iDLG with a batch of more
            than one. The message names the fix.
    """
    fed = cfg.federation
    if data.vocab_size is not None or len(data.input_shape) != 3:
        raise ConfigError(
            f"plfl invert reconstructs images (C, H, W), but {data.name}'s inputs have shape "
            f"{tuple(data.input_shape)}. Choose an image data source (e.g. data.source=digits)."
        )
    if not method_class(cfg.method.name).uploads_model:
        raise ConfigError(
            f"method.name={cfg.method.name} does not upload a model (its message holds other tensors), so its upload "
            "is not a gradient step. Choose a method that uploads its model, e.g. method=fedavg."
        )
    if fed.local_steps != 1:
        raise ConfigError(
            f"plfl invert reads one gradient from an upload of one local step, but federation.local_steps is "
            f"{fed.local_steps}. Pass federation.local_steps=1 (and federation.local_epochs=null if the config sets "
            "it)."
        )
    if fed.momentum != 0:
        raise ConfigError(
            f"plfl invert reads the gradient from a plain SGD step, but federation.momentum is {fed.momentum}. "
            "Pass federation.momentum=0."
        )
    if cfg.data.augment or cfg.attack.kind != "none":
        raise ConfigError(
            "plfl invert compares with the client's stored samples, which data.augment or attack.kind change. "
            "Set data.augment=false and attack.kind=none."
        )
    if not 1 <= round_ <= fed.rounds:
        raise ConfigError(
            f"--round {round_} is not a training round of the run, whose rounds are 1..{fed.rounds} "
            "(federation.rounds). Choose one of them."
        )
    if not 0 <= client < len(data.clients):
        raise ConfigError(
            f"--client {client} is not a client of the run, whose clients are 0..{len(data.clients) - 1}. "
            "Choose one of them."
        )
    sampled = sample_clients(fed.seed, round_, len(data.clients), fed.join_ratio)
    if client not in sampled:
        raise ConfigError(
            f"client {client} does not train in round {round_}: the clients sampled then are {sampled}. Choose "
            "one of them, or another round."
        )
    if attack == "idlg" and fed.batch_size != 1:
        raise ConfigError(
            f"--attack idlg reads the label of a batch of one, but the batch size is {fed.batch_size}. Pass "
            "--batch-size 1, or --attack dlg."
        )


def true_batch(cfg: DictConfig, data: FederatedData, model: nn.Module, client: int, round_: int) -> torch.Tensor:
    """(B,) int64 indices into the client's training split: its one training batch in ``round_`` (the one batch
    order, :func:`plfl.batches.training_rows`, seeded as :meth:`Method.train_task` seeds local training)."""
    fed = cfg.federation
    n = data.clients[client].num_train
    seed = derive_seed(fed.seed, round_, client, "local_training")
    minimum = last_batch_minimum(fed.batch_size, has_batch_norm(model), drop_last=fed.drop_last)
    row = training_rows(n, fed.batch_size, seed, steps=1, min_last=minimum)[0]
    return row[row >= 0]


def pixel_range(source: str, images: torch.Tensor) -> tuple[float, float]:
    """The range [low, high] ``source`` stores its images in (:data:`PIXEL_RANGES`; torchvision's: [−1, 1]); for
    per-channel normalised sources, the smallest and largest value of ``images``."""
    if source in PIXEL_RANGES:
        return PIXEL_RANGES[source]
    if source in ("imagefolder", "hf"):
        return images.min().item(), images.max().item()
    return TORCHVISION_RANGE


def invert(
    cfg: DictConfig, client: int, round_: int, attack: str, iterations: int, restarts: int = 1
) -> tuple[Path, dict[str, Any]]:
    """Run the federation of ``cfg`` (validated) to ``round_`` (:func:`plfl.experiment.run_experiment`), take
    client ``client``'s upload of that round as a gradient (:func:`observed_gradient`) at the model it received
    (the checkpoint of round ``round_`` − 1), reconstruct its batch with ``attack`` (dlg, idlg) for ``iterations``
    L-BFGS iterations from each of ``restarts`` draws (from the stream "inversion" of the run's seed, the round and
    the client), and write ``inversion.json`` and ``inversion.png`` (true
    images above their reconstructions) into the run directory.

    Returns:
        The run directory and what inversion.json holds: ``psnr`` and ``ssim`` per image (dB; in the data's
        pixel range mapped to [0, 1]; an exact reconstruction's is infinite), their means, ``label_accuracy``, the
        true and recovered ``labels``,
        ``gradient_error`` (‖g − ∇ℓ(true batch)‖ / ‖∇ℓ(true batch)‖: 0 up to rounding without DP), the kept
        draw's ``gradient_distance`` (Σ‖∇ℓ(x') − g‖²), the ``attack``, ``iterations``, ``restarts``, ``client``,
        ``round``, ``batch_size`` and ``privacy`` level. JSON has no infinity: the file holds null for each
        number that is not finite.

    Raises:
        ConfigError: :func:`check_inversion`'s refusals (before any run), or a method whose client does not train
            from the model it received.
        FederationError: the client's training in that round failed (no upload).

    Warns:
        PlflWarning: without DP in local training, ``gradient_error`` above :data:`GRADIENT_TOLERANCE`.
    """
    config = OmegaConf.to_object(cfg)
    data = participants(load_federated_data(config.data, cfg.federation.seed), cfg)
    check_inversion(cfg, data, client, round_, attack)
    model = models()[config.model.name].of(config.model).build(data.input_shape, data.num_classes, data.vocab_size)
    model = method_class(cfg.method.name).client_network(model).train()
    cfg = OmegaConf.merge(cfg, {"federation": {"rounds": round_}, "checkpoint_every": 1, "keep_checkpoints": 2})
    recorder = UploadRecorder(client, round_)
    run_dir, _ = run_experiment(cfg, callbacks=[recorder])
    before = read_checkpoint(checkpoint_path(run_dir / "checkpoints", round_ - 1))
    sent, start = before["received"][client], before["store"][client]["model"]
    names = [name for name, _ in model.named_parameters()]
    if sent is None or any(k not in sent or not torch.equal(sent[k], start[k]) for k in names):
        raise ConfigError(
            f"method.name={cfg.method.name}'s client does not start its training from the whole model the server "
            "sent, so its upload is not one gradient at a model the server knows. Choose a method whose clients "
            "train the received model, e.g. method=fedavg."
        )
    if recorder.upload is None:  # the loop warned and left the client out
        raise FederationError(
            f"client {client}'s local training in round {round_} failed, so it uploaded nothing (the run's warning "
            "says why). Choose another client or round, or lower federation.lr."
        )
    gradient = observed_gradient(sent, recorder.upload, cfg.federation.lr, names)
    index = true_batch(cfg, data, model, client, round_)
    x, y = data.clients[client].x_train[index], data.clients[client].y_train[index]
    sent = {k: v.double() if v.is_floating_point() else v for k, v in sent.items()}
    truth = batch_gradient(model, sent, x.double(), y)
    error = (
        torch.cat([(gradient[k] - truth[k]).flatten() for k in names]).norm()
        / torch.cat([t.flatten() for t in truth.values()]).norm()
    )
    if error > GRADIENT_TOLERANCE and cfg.privacy.level in ("none", "client"):  # no noise in local training
        warnings.warn(
            PlflWarning(
                f"client {client}'s upload of round {round_} differs from the gradient of the batch plfl's batch "
                f"order gives (relative error {error:.2g}): method.name={cfg.method.name}'s local training is not "
                "one plain SGD step on it, and the reconstruction is compared with other images."
            ),
            stacklevel=2,
        )
    seed = derive_seed(cfg.federation.seed, round_, client, "inversion")
    shape, k = tuple(data.input_shape), data.num_classes
    if attack == "idlg":
        result = idlg(model, sent, gradient, shape, k, iterations, seed, restarts)
    else:
        result = dlg(model, sent, gradient, shape, k, len(index), iterations, seed, restarts=restarts)
    low, high = pixel_range(cfg.data.source, data.clients[client].x_train)
    true_images, recon = unit_range(x.double(), low, high), unit_range(result.x, low, high)
    order = matched(true_images, recon)
    recon, labels = recon[order], result.labels[order]
    psnrs, ssims = psnr(true_images, recon), ssim(true_images, recon)
    report = {
        "attack": attack,
        "iterations": iterations,
        "restarts": restarts,
        "client": client,
        "round": round_,
        "batch_size": len(index),
        "privacy": cfg.privacy.level,
        "psnr": psnrs.tolist(),
        "ssim": ssims.tolist(),
        "mean_psnr": psnrs.mean().item(),
        "mean_ssim": ssims.mean().item(),
        "label_accuracy": (labels == y).double().mean().item(),
        "labels": y.tolist(),
        "recovered_labels": labels.tolist(),
        "gradient_error": error.item(),
        "gradient_distance": result.distance,
    }
    (run_dir / "inversion.json").write_text(json.dumps(finite_or_null(report), indent=2, allow_nan=False) + "\n")
    save_pair(true_images, recon, run_dir / "inversion.png")
    return run_dir, report


def save_pair(true: torch.Tensor, recon: torch.Tensor, path: Path) -> None:
    """A PNG of the true images (B, C, H, W) in [0, 1] in the top row and their reconstructions below, each
    enlarged to at least 64 pixels a side (nearest neighbour)."""
    from torchvision.utils import save_image

    scale = max(1, 64 // min(true.shape[-2:]))
    grid = torch.cat([true, recon]).float().repeat_interleave(scale, dim=-2).repeat_interleave(scale, dim=-1)
    save_image(grid, path, nrow=len(true), padding=2, pad_value=1.0)


def finite_or_null(value: Any) -> Any:
    """``value`` (numbers, lists and dicts of them) with each float that is not finite replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite_or_null(v) for v in value]
    return value


def table(report: dict[str, Any]) -> str:
    """The per-image PSNR, SSIM and labels of ``report`` (:func:`invert`) and their means, as text."""
    lines = [f"{'image':>5}  {'PSNR (dB)':>9}  {'SSIM':>6}  label  recovered"]
    rows = zip(report["psnr"], report["ssim"], report["labels"], report["recovered_labels"])
    lines += [f"{i:>5}  {p:>9.2f}  {s:>6.3f}  {y:>5}  {r:>9}" for i, (p, s, y, r) in enumerate(rows)]
    lines.append(
        f"{'mean':>5}  {report['mean_psnr']:>9.2f}  {report['mean_ssim']:>6.3f}  label accuracy "
        f"{100 * report['label_accuracy']:.0f} %"
    )
    return "\n".join(lines)
