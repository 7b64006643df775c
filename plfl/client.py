"""A client as a LightningModule, and local training with one reused Trainer.

One :class:`ClientModule` and one Lightning ``Trainer`` serve every client and
round: :class:`LocalTrainer` loads a client's parameters into the module,
runs ``trainer.fit`` for a number of local epochs or steps, and reads the
trained parameters back. Nothing of a client stays in the module.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, Dataset, Sampler

from plfl.seeding import AUGMENTATION, SHUFFLING, derive_seed
from plfl.state import Params

EVAL_BATCH_SIZE = 1000

# Lightning announces every fit's stop reason and the hardware at INFO level;
# with one fit per client per round that drowns the console.
for _name in ("lightning.pytorch.utilities.rank_zero", "lightning.pytorch.accelerators.cuda"):
    logging.getLogger(_name).setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")
warnings.filterwarnings("ignore", message=".*treespec, LeafSpec.*")
# ClientModule.training_step takes a local epoch's batches from dataloader_iter; Lightning warns that its
# batch_idx then counts training_step calls, which plfl never reads.
warnings.filterwarnings("ignore", message=".*`dataloader_iter`.*")


class TensorBatches(Dataset):
    """Batches ``(x[index], y[index])`` for a tensor ``index`` of sample indices (one indexing op per batch)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def _as_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch  # TensorBatches already returns the collated batch


class EpochShuffle(Sampler[int]):
    """Indices 0..n-1 in a new order each local epoch: epoch k's order is a permutation drawn from (seed, k);
    the first ``size`` of them (default n).

    Lightning numbers epochs across all fits of a Trainer and tells samplers
    the epoch with ``set_epoch``; k counts from ``first_epoch``, the Trainer's
    epoch when this fit starts. Drawing from (seed, k) instead of one running
    generator matters: a reused Trainer starts an iteration and discards it at
    the start of every fit after its first, so a running generator would make
    a client's batches depend on how many fits the Trainer ran before (and a
    resumed run would differ from an uninterrupted one).
    """

    def __init__(self, n: int, seed: int, first_epoch: int, size: Optional[int] = None):
        self.n, self.seed, self.first_epoch = n, seed, first_epoch
        self.size = n if size is None else size
        self.epoch = first_epoch

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def order(self) -> torch.Tensor:
        """This epoch's (size,) int64 indices."""
        return epoch_order(self.n, self.seed, self.epoch - self.first_epoch)[: self.size]

    def __iter__(self) -> Iterator[int]:
        yield from self.order().tolist()


def epoch_order(n: int, seed: int, local_epoch: int) -> torch.Tensor:
    """The (n,) int64 permutation of 0..n-1 that a training seeded ``seed`` visits in its epoch ``local_epoch``
    (0 first)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, local_epoch, 0, SHUFFLING)))


class IndexBatches(Sampler[torch.Tensor]):
    """``shuffle``'s order each epoch (None: 0..n-1) in index tensors of ``batch_size`` (the last may be
    smaller). Slicing one index tensor per epoch avoids a BatchSampler's per-sample Python ints."""

    def __init__(self, n: int, batch_size: int, shuffle: Optional[EpochShuffle] = None):
        self.n, self.batch_size, self.shuffle = n, batch_size, shuffle

    def set_epoch(self, epoch: int) -> None:
        if self.shuffle is not None:
            self.shuffle.set_epoch(epoch)

    def __len__(self) -> int:
        return -(-(self.n if self.shuffle is None else len(self.shuffle)) // self.batch_size)

    def __iter__(self) -> Iterator[torch.Tensor]:
        order = torch.arange(self.n) if self.shuffle is None else self.shuffle.order()
        return iter(order.split(self.batch_size))


def batch_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: Optional[int] = None,
                 first_epoch: int = 0, size: Optional[int] = None) -> DataLoader:
    """Mini-batches of ``(x, y)``, reshuffled each epoch from ``seed`` (:class:`EpochShuffle`; None: in order);
    with a seed, ``size`` samples of each epoch's order (default all). ``loader.sampler.set_epoch`` picks the
    epoch's order."""
    shuffle = None if seed is None else EpochShuffle(len(y), seed, first_epoch, size)
    sampler = IndexBatches(len(y), batch_size, shuffle)
    return DataLoader(TensorBatches(x, y), sampler=sampler, batch_size=None, collate_fn=_as_batch)


class ClientModule(L.LightningModule):
    """Cross-entropy classification with SGD, shared by all clients.

    Tracks the sample-weighted mean training loss of the last fit and, in
    test mode, the accuracy (torchmetrics) and mean loss on a client's test split.
    ``train_transform(x, generator)`` (e.g. :func:`plfl.data.augment.random_crop_flip`) maps each
    training batch's inputs before the forward pass, drawing from ``self.generator``, which
    :class:`LocalTrainer` seeds for every fit; evaluation never transforms.
    """

    def __init__(self, model: nn.Module, num_classes: int, lr: float, momentum: float = 0.0,
                 train_transform: Optional[Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = None):
        super().__init__()
        if any(isinstance(m, nn.Conv2d) for m in model.modules()):
            # Faster convolutions and pooling on the CPU: benchmarks/overhead.py's plain loop took 11-20 % less
            # time with it (both sides of that benchmark use it).
            model.to(memory_format=torch.channels_last)
        self.model = model
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
        (``trainer.max_steps``) run out; each batch is x (B, *input_shape), y (B,) int64 labels, already on
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
        if self.proximal is not None:
            loss = loss + self.proximal.penalty(self.model)
        self.manual_backward(loss)
        optimizer.step()

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
        return torch.optim.SGD(trainable, lr=self.lr, momentum=self.momentum)

    @property
    def mean_train_loss(self) -> float:
        """Sample-weighted mean training loss of the last fit (NaN if it saw no samples)."""
        return (self._loss_sum / self.samples_seen).item() if self.samples_seen else float("nan")


@dataclass(frozen=True)
class ProximalTerm:
    """μ/2 · Σ ‖θ − anchor‖² over the trainable parameters, added to the local loss.

    FedProx's proximal term (Li et al., MLSys 2020, Eq. 2) with ``anchor`` the received global
    model; Ditto's personal objective (Li et al., ICML 2021, Eq. 2) with μ = λ. Its gradient
    adds μ(θ − anchor) to the cross-entropy's.
    """

    anchor: Params  # state_dict names → tensors; only the model's parameters are used
    mu: float  # μ ≥ 0

    def penalty(self, model: nn.Module) -> torch.Tensor:
        """The scalar term for ``model``'s current parameters (frozen parameters count 0)."""
        terms = [(p - self.anchor[name]).pow(2).sum() for name, p in model.named_parameters() if p.requires_grad]
        return self.mu / 2 * torch.stack(terms).sum()

    def to(self, device: torch.device) -> ProximalTerm:
        return ProximalTerm({k: v.to(device) for k, v in self.anchor.items()}, self.mu)


@dataclass
class TrainResult:
    """Outcome of one client's local training."""

    params: Params  # trained state (CPU tensors): the client's model from now on
    loss: float  # sample-weighted mean cross-entropy over the steps taken (no proximal term)
    samples_seen: int  # training samples processed (epochs × n, or steps × batch; see LocalTrainer on BatchNorm)
    # What the client uploads when it is not ``params``, e.g. Ditto's trained copy of the global
    # model beside its personal model (Method.client_message).
    upload: Optional[Params] = None


@dataclass
class EvalResult:
    """A model on one test split: ``correct`` of ``total`` samples, mean cross-entropy ``loss``."""

    correct: int
    total: int
    loss: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")


class LocalTrainer:
    """Runs local training and evaluation of any client on one reused Lightning Trainer.

    Lightning's fit loop keeps its progress between ``fit`` calls, so each call
    raises the epoch or step limit by exactly the amount of local training asked
    for; the test ``test_reused_trainer_trains_every_client`` guards this.

    A model with BatchNorm layers cannot train on a batch of one sample (torch
    raises: a batch statistic needs two values per channel), so when n mod
    batch size = 1 each epoch leaves out its last shuffled sample, a different
    one every epoch. PFLlib drops every incomplete last batch instead.
    """

    def __init__(self, module: ClientModule, trainer: L.Trainer, batch_size: int):
        self.module = module
        self.trainer = trainer
        self.batch_size = batch_size
        self.batch_norm = any(isinstance(m, _BatchNorm) for m in module.model.modules())

    def epoch_size(self, n: int) -> int:
        """How many of n training samples a local epoch visits: n, or n - 1 for a model with BatchNorm when a
        last batch of one sample would remain (the class docstring's BatchNorm rule)."""
        return n - 1 if self.batch_norm and n > 1 and n % self.batch_size == 1 else n

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
            x: (n, *input_shape) training inputs; y: (n,) int64 labels.
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
        loader = batch_loader(x, y, self.batch_size, seed, first_epoch=self.trainer.current_epoch,
                              size=self.epoch_size(len(y)))
        self.module.proximal = proximal
        # Seeded per fit, not once per run: a fit's draws depend only on its seed (and so survive a resume).
        self.module.generator.manual_seed(derive_seed(seed, 0, 0, AUGMENTATION))
        try:
            self.trainer.fit(self.module, train_dataloaders=loader)
        finally:
            self.module.proximal = None
        for p in model.parameters():
            p.requires_grad_(True)
        trained = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        return TrainResult(trained, self.module.mean_train_loss, self.module.samples_seen)

    def evaluate(self, params: Params, x: torch.Tensor, y: torch.Tensor) -> EvalResult:
        """Accuracy and mean loss of ``params`` on ``(x, y)``; x: (n, *input_shape), y: (n,)."""
        module = self.module
        module.model.load_state_dict(params)
        module.test_accuracy.reset()
        module.test_loss.reset()
        self.trainer.test(module, dataloaders=batch_loader(x, y, EVAL_BATCH_SIZE, None), verbose=False)
        total = len(y)
        correct = round(module.test_accuracy.compute().item() * total)
        return EvalResult(correct, total, module.test_loss.compute().item())


def build_trainer(accelerator: str, devices: int, precision: str) -> L.Trainer:
    """The one Trainer of a run, in Lightning's barebones mode: no loggers, checkpoints, summaries,
    progress bars or sanity checks per client, and no per-step logging checks (``log_every_n_steps=0``).
    Applies :func:`use_precision` for the process."""
    use_precision(precision)
    return L.Trainer(accelerator=accelerator, devices=devices, precision=precision, max_epochs=1, barebones=True)


def use_precision(precision: str) -> None:
    """Make ``trainer.precision=32-true`` IEEE float32 on CUDA too, for every executor: cuDNN's convolutions
    otherwise compute in TF32 (a 10-bit mantissa) on Ampere and newer GPUs by default, and a GPU run would
    drift from the CPU's by more than float rounding. Process-wide (torch.backends); other precisions are
    left to Lightning."""
    if precision == "32-true":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
