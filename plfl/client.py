"""A client as a LightningModule, and local training with one reused Trainer.

One :class:`ClientModule` and one Lightning ``Trainer`` serve every client and
round: :class:`LocalTrainer` loads a client's parameters into the module,
runs ``trainer.fit`` for a number of local epochs or steps, and reads the
trained parameters back. Nothing of a client stays in the module.
"""

from __future__ import annotations

import logging
import math
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn

from plfl.activity import current as activity
from plfl.batches import EVAL_BATCH_SIZE, batch_loader, has_batch_norm, last_batch_minimum
from plfl.models import channels_last
from plfl.privacy import noise_generator, per_sample_gradients
from plfl.sections import DPSGDNoise
from plfl.seeding import derive_seed
from plfl.state import Params
from plfl.tasks import EvalResult, ProximalTerm, TrainResult

# Notices Lightning gives at every fit or test, which with one fit per client per round would drown the console:
QUIET = (
    ".*does not have many workers.*",  # the tensors are in memory: loader workers would only add processes
    ".*smaller than the logging interval.*",  # plfl logs nothing per step
    ".*treespec, LeafSpec.*",  # Lightning 2.6's own use of a deprecated torch helper
    # ClientModule.training_step takes a local epoch's batches from dataloader_iter; Lightning warns that the
    # signature is experimental and that batch_idx then counts training_step calls, which plfl never reads.
    ".*`dataloader_iter`.*",
    # DP-SGD's per-sample gradients (Opacus' hooks): the first layer's inputs, the data, need no gradient.
    ".*Full backward hook is firing when gradients are computed with respect to module outputs.*",
)


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Within the block, Lightning's per-fit warnings in :data:`QUIET` are not shown."""
    with warnings.catch_warnings():
        for message in QUIET:
            warnings.filterwarnings("ignore", message=message)
        yield


class ClientModule(L.LightningModule):
    """Cross-entropy classification with SGD, shared by all clients.

    Tracks the sample-weighted mean training loss of the last fit and, in
    test mode, the accuracy (torchmetrics) and mean loss on a client's test split.
    ``train_transform(x, generator)`` (e.g. :func:`plfl.data.augment.random_crop_flip`) maps each
    training batch's inputs before the forward pass, drawing from ``self.generator``, which
    :class:`LocalTrainer` seeds for every fit; evaluation never transforms. With ``dp_sgd``, every step is DP-SGD
    (:mod:`plfl.privacy`): Opacus' ``DPOptimizer`` around the SGD, at expected batch size ``batch_size``, its noise
    drawn from ``self.noise``, which :class:`LocalTrainer` seeds for every fit; a proximal term's gradient is added
    after the noise.
    """

    def __init__(
        self,
        model: nn.Module,
        num_classes: int,
        lr: float,
        momentum: float = 0.0,
        train_transform: Optional[Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = None,
        dp_sgd: Optional[DPSGDNoise] = None,
        batch_size: int = 1,
    ):
        super().__init__()
        self.model = channels_last(model)
        self.lr = lr
        self.momentum = momentum
        self.test_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")
        self.test_loss = torchmetrics.MeanMetric()
        self.register_buffer("_loss_sum", torch.zeros(()), persistent=False)
        self._step_losses: list[tuple[torch.Tensor, int]] = []  # (loss, batch size) per step of the fit
        self.samples_seen = 0
        self.proximal: Optional[ProximalTerm] = None  # set by LocalTrainer.train for one fit
        self.train_transform = train_transform
        self.generator = torch.Generator()  # reseeded by LocalTrainer.train for every fit
        self.dp_sgd, self.batch_size = dp_sgd, batch_size
        self.noise: Optional[torch.Generator] = None  # DP-SGD's, made on the fit's device by LocalTrainer.train
        # Lightning's manual optimization: the same zero_grad, backward and step per batch, without the
        # automatic loop's closure and its per-step hook calls (measured in the commit that added this).
        self.automatic_optimization = False

    def __setattr__(self, name: str, value: object) -> None:
        # nn.Module.__setattr__ checks each assignment against the parameters, buffers and submodules, and
        # Lightning assigns the module's _current_fx_name twice per hook call, some 30 times a step. An
        # existing plain attribute given anything but a tensor or module ends in object.__setattr__ there.
        if name in self.__dict__ and not isinstance(value, (torch.Tensor, nn.Module)):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def on_fit_start(self) -> None:
        self._loss_sum.zero_()
        self._step_losses = []
        self.samples_seen = 0
        if self.proximal is not None:  # the anchor moves to the model's device once per fit
            self.proximal = self.proximal.to(self.device)

    def training_step(self, dataloader_iter: Iterator) -> None:
        """SGD steps on the loader's batches until this local epoch's batches or the fit's step budget
        (``trainer.max_steps``) run out; each batch is x ``(B, *input_shape)``, y (B,) int64 labels, already on
        the module's device (:meth:`LocalTrainer.train` moves a client's data there once per fit).

        Lightning's ``dataloader_iter`` flavour, so that its loop runs once per local epoch instead of once
        per batch: on a CPU its per-batch bookkeeping (fetch, progress, hooks, logger connector) cost
        0.36-0.45 ms a step, 8-10 % of the MNIST CNN's batch-10 step (benchmarks/overhead.py). Each step
        still goes through Lightning's ``manual_backward`` and optimizer wrapper, so precision plugins
        (autocast, gradient scaling) and the step counter behave as in a per-batch loop.
        """
        limit = self.trainer.max_steps  # -1: no step budget, the epoch's batches decide
        optimizer = self.optimizers()
        for (x, y), _, _ in dataloader_iter:
            self._sgd_step(optimizer, x, y)
            if self.trainer.global_step == limit:
                break

    def _sgd_step(self, optimizer: LightningOptimizer, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.train_transform is not None:
            x = self.train_transform(x, self.generator)
        optimizer.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        self._step_losses.append((loss.detach(), len(y)))  # summed in on_train_end
        self.samples_seen += len(y)
        if self.proximal is not None and self.dp_sgd is None:  # DP-SGD adds its gradient after the noise
            loss = loss + self.proximal.penalty(self.model)
        self.manual_backward(loss)
        optimizer.step()
        activity.add_steps()

    def on_train_end(self) -> None:
        # Summed as tensors (a .item() per step would synchronise every batch on a GPU), in step order: the
        # same float sums as at every step, where each tensor op costs several times more (the forward
        # pass has just evicted the caches). Here, before the fit's teardown moves the module.
        for loss, batch_size in self._step_losses:
            self._loss_sum.add_(loss * batch_size)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        self.test_accuracy.update(logits, y)
        self.test_loss.update(F.cross_entropy(logits, y), weight=len(y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        sgd = torch.optim.SGD(trainable, lr=self.lr, momentum=self.momentum)
        if self.dp_sgd is None:
            return sgd
        from opacus.optimizers import DPOptimizer  # only runs with privacy.level=sample need Opacus

        optimizer = DPOptimizer(
            sgd,
            noise_multiplier=self.dp_sgd.noise_multiplier,
            max_grad_norm=self.dp_sgd.max_grad_norm,
            expected_batch_size=self.batch_size,
            loss_reduction="mean",
            generator=self.noise,
        )
        if self.proximal is not None:  # its gradient does not depend on the samples: added to the noised one
            optimizer.attach_step_hook(lambda _: self._add_proximal_gradient(trainable))
        return optimizer

    def _add_proximal_gradient(self, trainable: list[nn.Parameter]) -> None:
        with torch.enable_grad():
            gradients = torch.autograd.grad(self.proximal.penalty(self.model), trainable)
        for p, g in zip(trainable, gradients):
            p.grad += g

    @property
    def mean_train_loss(self) -> float:
        """Sample-weighted mean training loss of the last fit (NaN if it saw no samples)."""
        return (self._loss_sum / self.samples_seen).item() if self.samples_seen else float("nan")


class LocalTrainer:
    """Runs local training and evaluation of any client on one reused Lightning Trainer.

    Lightning's fit loop keeps its progress between ``fit`` calls, so each call
    raises the epoch or step limit by exactly the amount of local training asked
    for; the test ``test_reused_trainer_trains_every_client`` guards this. The
    batches are the one batch order of :mod:`plfl.batches`, BatchNorm rule included.
    """

    def __init__(self, module: ClientModule, trainer: L.Trainer, batch_size: int, drop_last: bool = False):
        self.module = module
        self.trainer = trainer
        self.batch_size = batch_size
        self.min_last = last_batch_minimum(batch_size, has_batch_norm(module.model), drop_last=drop_last)

    def train(
        self,
        params: Params,
        x: torch.Tensor,
        y: torch.Tensor,
        seed: int,
        epochs: Optional[int] = None,
        steps: Optional[int] = None,
        trainable: Optional[set[str]] = None,
        proximal: Optional[ProximalTerm] = None,
    ) -> TrainResult:
        """Train from ``params`` on ``(x, y)`` for ``epochs`` epochs or ``steps`` SGD steps.

        Args:
            params: the starting state (not modified).
            x: ``(n, *input_shape)`` training inputs; y: (n,) int64 labels.
            seed: seeds the shuffling of the mini-batches and the module's ``train_transform``.
            epochs / steps: exactly one of them, ≥ 1.
            trainable: names of the parameters to update (default: all); the others stay frozen.
            proximal: a term added to the loss (FedProx, Ditto); the reported loss leaves it out.

        Raises:
            ValueError: neither or both of ``epochs`` and ``steps`` given.
        """
        if (epochs is None) == (steps is None):
            raise ValueError("give exactly one of epochs and steps")
        model = self.module.model
        model.load_state_dict(params)
        for name, p in model.named_parameters():
            p.requires_grad_(trainable is None or name in trainable)
        loop = self.trainer.fit_loop
        loop.max_epochs = self.trainer.current_epoch + epochs if epochs else -1
        loop.epoch_loop.max_steps = self.trainer.global_step + steps if steps else -1
        # Once per fit instead of per batch: Lightning's loop does not move or convert dataloader_iter's batches.
        device = self.trainer.strategy.root_device
        x, y = self.trainer.precision_plugin.convert_input((x.to(device), y.to(device)))
        loader = batch_loader(
            x, y, self.batch_size, seed, first_epoch=self.trainer.current_epoch, min_last=self.min_last
        )
        self.module.proximal = proximal
        # Seeded per fit, not once per run: a fit's draws depend only on its seed (and so survive a resume).
        self.module.generator.manual_seed(derive_seed(seed, 0, 0, "augmentation"))
        samples = None
        if self.module.dp_sgd is not None:
            self.module.noise = noise_generator(seed, device)
            samples = per_sample_gradients(model)
        try:
            with quiet_lightning():
                self.trainer.fit(self.module, train_dataloaders=loader)
        finally:
            self.module.proximal = None
            if samples is not None:
                samples.remove_hooks()
                for p in model.parameters():
                    p.grad_sample = None
        for p in model.parameters():
            p.requires_grad_(True)
        trained = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        return TrainResult(trained, self.module.mean_train_loss, self.module.samples_seen)

    def evaluate(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> EvalResult:
        """Accuracy and mean loss of ``params`` on ``(x, y)``; x: ``(n, *input_shape)``, y: (n,). With n = 0 (a
        client whose split is empty, e.g. no triggered test image), 0 of 0 correct and a NaN loss, without a test
        loop: Lightning and torchmetrics would warn on every such client in every evaluation."""
        if not len(y):
            return EvalResult(0, 0, math.nan)
        module = self.module
        module.model.load_state_dict(params)
        module.test_accuracy.reset()
        module.test_loss.reset()
        with quiet_lightning():
            self.trainer.test(module, dataloaders=batch_loader(x, y, EVAL_BATCH_SIZE, None), verbose=False)
        total = len(y)
        correct = round(module.test_accuracy.compute().item() * total)
        return EvalResult(correct, total, module.test_loss.compute().item())


def build_trainer(accelerator: str, devices: int, precision: str) -> L.Trainer:
    """The one Trainer of a run, in Lightning's barebones mode: no loggers, checkpoints, summaries,
    progress bars or sanity checks per client, and no per-step logging checks (``log_every_n_steps=0``).
    Applies :func:`use_precision` for the process, and keeps Lightning's INFO notices (every fit's stop
    reason, the hardware, a SIGTERM it passes on to plfl's handler) off the console: with one fit per client
    per round they would drown it."""
    use_precision(precision)
    for name in (
        "lightning.pytorch.utilities.rank_zero",
        "lightning.pytorch.accelerators.cuda",
        "lightning.pytorch.trainer.connectors.signal_connector",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)
    return L.Trainer(accelerator=accelerator, devices=devices, precision=precision, max_epochs=1, barebones=True)


def use_precision(precision: str) -> None:
    """Make ``trainer.precision=32-true`` IEEE float32 on CUDA too, for every executor: cuDNN's convolutions
    otherwise compute in TF32 (a 10-bit mantissa) on Ampere and newer GPUs by default, and a GPU run would
    drift from the CPU's by more than float rounding. Process-wide (torch.backends); other precisions are
    left to Lightning."""
    if precision == "32-true":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
