"""Differential privacy: client-level (``privacy.level=client``), DP-FedAvg's server rule and its accountant;
sample-level (``privacy.level=sample``), DP-SGD's private gradient and each client's accountant.

DP-FedAvg (McMahan et al., *Learning Differentially Private Recurrent Language Models*, ICLR 2018,
arXiv:1710.06963, Alg. 1) with fixed clipping, and adaptive clipping (Andrew et al., *Differentially Private
Learning with Adaptive Clipping*, NeurIPS 2021, arXiv:1905.03871, Alg. 1 and Theorem 1). With the m clients that
uploaded in a round, the model θ_sent they received and the clip norm C:

- each update u_i = θ_i − θ_sent, over every floating-point tensor, is clipped to ũ_i = u_i · min(1, C / ‖u_i‖₂),
  the norm over the whole update (:func:`clipped_update`);
- θ ← θ_sent + (1/m) Σ_i ũ_i + N(0, (z_Δ C / m)²) per scalar (:func:`private_mean`);
- adaptively, b̄ = (Σ_i 1[‖u_i‖₂ ≤ C] + N(0, σ_b²)) / m and C ← C · exp(−η_C (b̄ − γ)) after the round
  (:func:`adapted_clip`); the update's noise multiplier is z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2), so that the round as a
  whole is the Gaussian mechanism of noise multiplier z (Theorem 1, :func:`update_noise_multiplier`); with fixed
  clipping z_Δ = z.

The mean is unweighted, as in Andrew et al.: a client's training samples do not weigh its update (McMahan et al.
bound per-client weights instead). Integer buffers (e.g. BatchNorm's counter) come from the first upload, as
:func:`plfl.robust.weighted_average` takes them. Every draw comes from a CPU generator seeded by
:func:`plfl.seeding.derive_seed` (seed, round, −1, stream "dp_noise" or "dp_clip_noise"), so a run is the same on
every executor and resumes bit for bit; the clip norm C is the only state (:meth:`ClientLevelDP.state_dict`).

ε comes from Opacus' accountants (RDP or PRV), one Gaussian mechanism of noise multiplier z and sample rate
q = (clients sampled per round) / (participating clients) per aggregated round. They assume each client is
sampled independently with probability q (Poisson sampling); plfl samples a fixed number without replacement,
the usual approximation.

Sample-level DP is DP-SGD (Abadi et al., *Deep Learning with Differential Privacy*, CCS 2016, arXiv:1607.00133,
Alg. 1) in every local step of every client: with the batch's per-sample gradients g_j over the trainable
parameters, the clip norm C, the noise multiplier σ and the expected batch size B (``federation.batch_size``; a
short last batch is divided by B too, as Opacus does),

    g̃ = (Σ_j g_j · min(1, C / (‖g_j‖₂ + 10⁻⁶)) + N(0, σ²C²)) / B     (:func:`private_gradient`)

then the optimiser's step (a proximal term's gradient, which does not depend on the data, is added to g̃). The
10⁻⁶ is Opacus' (``DPOptimizer.clip_and_accumulate``). The sequential executor runs Opacus' ``GradSampleModule``
and ``DPOptimizer``; the vectorized one computes the same with ``torch.func`` and draws the noise as Opacus does
(:func:`dp_sgd_noise`), each client's from a generator seeded by its training task's seed
(:func:`noise_generator`), so that both give the same numbers. Each client's ε comes from its own Opacus
accountant, one step of sample rate q = B / n per local step on n training samples (:class:`SampleLevelDP`).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from plfl.batches import epoch_size
from plfl.errors import ConfigError
from plfl.sections import DPSGDNoise, PrivacyConfig
from plfl.seeding import derive_seed
from plfl.state import Params


def clipped_update(state: Params, sent: Params, clip: float) -> tuple[Params, float]:
    """The update u = θ − θ_sent of ``state`` from ``sent`` over its floating-point tensors, scaled by
    min(1, C / ‖u‖₂) with C = ``clip`` (McMahan et al., ICLR 2018, Alg. 1, ClipFn), and ‖u‖₂ before clipping
    (float64, over all those tensors together). The tensors keep their shapes and dtypes."""
    update = {k: v - sent[k] for k, v in state.items() if v.is_floating_point()}
    norm = math.sqrt(sum(u.double().square().sum().item() for u in update.values()))
    factor = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: u * factor for k, u in update.items()}, norm


def private_mean(
    states: list[Params], sent: Params, clip: float, noise_multiplier: float, generator: torch.Generator
) -> tuple[Params, list[float]]:
    """θ_sent + (1/m) Σ_i ũ_i + N(0, (z_Δ C / m)²) per scalar of every floating-point tensor (McMahan et al.,
    ICLR 2018, Alg. 1; Andrew et al., NeurIPS 2021, Alg. 1), ũ_i the :func:`clipped_update` of the m ``states``
    from ``sent``, C = ``clip``, z_Δ = ``noise_multiplier`` (0: no noise). The noise is drawn from ``generator``
    (on the CPU), one tensor after another in the first state's key order, in each tensor's dtype, then moved to its
    device. Integer tensors come from the first state. Returns the new model and the m norms ‖u_i‖₂ before
    clipping.

    Raises:
        ValueError: no states.
    """
    if not states:
        raise ValueError("client-level DP averages the updates of at least one client, got none")
    m = len(states)
    clipped, norms = zip(*(clipped_update(s, sent, clip) for s in states))
    std = noise_multiplier * clip / m
    averaged = {}
    for key, first in states[0].items():
        if not first.is_floating_point():
            averaged[key] = first.clone()
            continue
        noise = torch.randn(first.shape, generator=generator, dtype=first.dtype).to(first.device)
        averaged[key] = sent[key] + sum(u[key] for u in clipped) / m + std * noise
    return averaged, list(norms)


def update_noise_multiplier(noise_multiplier: float, quantile_noise: Optional[float]) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2), the noise multiplier of the update when σ_b = ``quantile_noise`` noises the
    clipped-count estimate, so that the round is the Gaussian mechanism of noise multiplier z =
    ``noise_multiplier`` (Andrew et al., NeurIPS 2021, Theorem 1); z itself when ``quantile_noise`` is None
    (fixed clipping).

    Raises:
        ValueError: 2σ_b ≤ z, which leaves no budget for the update (the message names the smallest σ_b).
    """
    if quantile_noise is None:
        return noise_multiplier
    if 2 * quantile_noise <= noise_multiplier:
        raise ValueError(
            f"privacy.quantile_noise (σ_b = {quantile_noise:g}) must exceed privacy.noise_multiplier / 2 "
            f"(z / 2 = {noise_multiplier / 2:g}): the update's noise multiplier (z⁻² − (2σ_b)⁻²)^(−1/2) is otherwise "
            "not finite (Andrew et al., Theorem 1). Raise privacy.quantile_noise (the paper takes about m / 20 for m "
            "clients per round), or lower privacy.noise_multiplier."
        )
    return (noise_multiplier**-2 - (2 * quantile_noise) ** -2) ** -0.5


def adapted_clip(
    clip: float,
    norms: list[float],
    target_quantile: float,
    clip_lr: float,
    quantile_noise: float,
    generator: torch.Generator,
) -> tuple[float, float]:
    """(C · exp(−η_C (b̄ − γ)), b̄): the geometric update of the clip norm C = ``clip`` toward the ``target_quantile``
    γ of the update norms (Andrew et al., NeurIPS 2021, Alg. 1), with b̄ = (Σ_i 1[‖u_i‖₂ ≤ C] + N(0, σ_b²)) / m the
    noisy fraction of the m ``norms`` left unclipped, σ_b = ``quantile_noise`` (one float64 draw from
    ``generator``), η_C = ``clip_lr``."""
    noise = torch.randn((), generator=generator, dtype=torch.float64).item()
    unclipped = (sum(norm <= clip for norm in norms) + quantile_noise * noise) / len(norms)
    return clip * math.exp(-clip_lr * (unclipped - target_quantile)), unclipped


class ClientLevelDP:
    """The server's client-level DP (``privacy.*`` with ``privacy.level=client``): its clip norm, its rounds and
    its accountant.

    Args:
        config: the ``privacy.*`` keys.
        seed: ``federation.seed``, of the noise's generators.
        clients_per_round: the clients sampled each round; σ_b's default is a twentieth of it (Andrew et al.'s
            experiments: σ_b = m / 20).
        num_clients: the participating clients; with ``clients_per_round``, the accountant's sample rate q.

    Raises:
        ConfigError: Opacus is not installed, or σ_b ≤ z / 2 (:func:`update_noise_multiplier`).
    """

    def __init__(self, config: PrivacyConfig, seed: int, clients_per_round: int, num_clients: int):
        self.config, self.seed = config, seed
        self.sample_rate = clients_per_round / num_clients
        self.quantile_noise = None
        if config.adaptive:
            given = config.quantile_noise
            self.quantile_noise = clients_per_round / 20 if given is None else given
        try:
            self.update_noise = update_noise_multiplier(config.noise_multiplier, self.quantile_noise)
        except ValueError as error:
            raise ConfigError(f"privacy.adaptive=true: {error}") from None
        self.clip, self.rounds = config.clip, 0
        self.accountant = new_accountant(config.accountant)
        self.unclipped: Optional[float] = None  # b̄ of the round just aggregated, for its metrics

    def aggregate(self, states: list[Params], sent: Params, round_: int) -> Params:
        """The round's model from the uploads ``states`` and the model ``sent`` (:func:`private_mean`); then, with
        adaptive clipping, the next round's C (:func:`adapted_clip`); one step of the accountant.

        Raises:
            ValueError: no states.
        """
        generator = torch.Generator().manual_seed(derive_seed(self.seed, round_, -1, "dp_noise"))
        averaged, norms = private_mean(states, sent, self.clip, self.update_noise, generator)
        if self.quantile_noise is not None:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, round_, -1, "dp_clip_noise"))
            config = self.config
            self.clip, self.unclipped = adapted_clip(
                self.clip, norms, config.target_quantile, config.clip_lr, self.quantile_noise, generator
            )
        self.rounds += 1
        self.accountant.step(noise_multiplier=self.config.noise_multiplier, sample_rate=self.sample_rate)
        return averaged

    def epsilon(self) -> float:
        """ε of (ε, ``privacy.delta``)-DP at the client level after the rounds so far (0 before the first)."""
        # float(): PRV's ε is a NumPy scalar, which a checkpoint (torch.load with weights_only) refuses
        return float(self.accountant.get_epsilon(delta=self.config.delta)) if self.rounds else 0.0

    def round_metrics(self) -> dict[str, float]:
        """``epsilon`` so far and the clip norm C the next round uses (``clip``); after an adaptive round, its
        noisy unclipped fraction b̄ (``unclipped_fraction``)."""
        metrics = {"epsilon": self.epsilon(), "clip": self.clip}
        if self.unclipped is not None:
            metrics["unclipped_fraction"], self.unclipped = self.unclipped, None
        return metrics

    def summary(self) -> dict[str, Any]:
        """The run's final ``epsilon`` with its ``delta`` and the ``accountant`` that computed it."""
        return {"epsilon": self.epsilon(), "delta": self.config.delta, "accountant": self.config.accountant}

    def state_dict(self) -> dict[str, Any]:
        """The clip norm and the number of aggregated rounds (the accountant's history: one step per round)."""
        return {"clip": self.clip, "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; the accountant takes its steps again."""
        self.clip, self.rounds = state["clip"], state["rounds"]
        self.accountant = new_accountant(self.config.accountant)
        for _ in range(self.rounds):
            self.accountant.step(noise_multiplier=self.config.noise_multiplier, sample_rate=self.sample_rate)


def noise_generator(seed: int, device: torch.device) -> torch.Generator:
    """The generator of DP-SGD's noise in a training seeded ``seed`` (a task's seed, itself derived from the run's
    seed, the round, the client and the training's stream), on ``device``: stream ``dp_sgd_noise``."""
    return torch.Generator(device).manual_seed(derive_seed(seed, 0, 0, "dp_sgd_noise"))


def per_sample_gradients(model: torch.nn.Module) -> Any:
    """Opacus' ``GradSampleModule`` hooks on ``model``'s layers: each backward pass of a batch-mean loss through
    ``model`` leaves every trainable parameter's (B, *shape) per-sample gradients in ``p.grad_sample``, which
    ``DPOptimizer`` clips and noises. The caller removes them (``remove_hooks``) after training. In-place
    activations (plfl's ``nn.ReLU(inplace=True)``) are switched to out-of-place for good: the same values, and
    Opacus' backward hooks refuse a view modified in place.

    Raises:
        ConfigError: Opacus is not installed.
    """
    new_accountant("rdp", "sample")  # the install hint, when Opacus is missing
    from opacus import GradSampleModule

    for module in model.modules():
        if getattr(module, "inplace", False):
            module.inplace = False
    return GradSampleModule(model, loss_reduction="mean")


def dp_sgd_noise(shape: torch.Size, std: float, generator: torch.Generator) -> torch.Tensor:
    """N(0, ``std``²) per scalar of a tensor of ``shape`` (float32), on ``generator``'s device: Opacus'
    ``_generate_noise`` draw, one call per parameter in the optimiser's order."""
    return torch.normal(mean=0, std=std, size=tuple(shape), device=generator.device, generator=generator)


def private_gradient(
    per_sample: Sequence[torch.Tensor],
    mask: torch.Tensor,
    noise: Sequence[torch.Tensor],
    max_grad_norm: float,
    batch_size: int,
) -> list[torch.Tensor]:
    """DP-SGD's gradient (Abadi et al., CCS 2016, Alg. 1; see the module docstring): (Σ_j m_j g_j ·
    min(1, C / (‖g_j‖₂ + 10⁻⁶)) + noise) / B, per parameter.

    Args:
        per_sample: per parameter, the (W, *shape) gradients of the W samples' losses.
        mask: (W,) 1 for a real sample, 0 for padding.
        noise: per parameter, the (*shape) draw N(0, σ²C²) (:func:`dp_sgd_noise`).
        max_grad_norm: C; batch_size: B, the expected batch size.
    """
    norms = torch.stack([g.reshape(len(g), -1).norm(2, dim=-1) for g in per_sample], dim=1).norm(2, dim=1)
    factor = (max_grad_norm / (norms + 1e-6)).clamp(max=1.0) * mask
    return [(torch.einsum("i,i...", factor, g) + z) / batch_size for g, z in zip(per_sample, noise)]


def local_steps(
    n: int, batch_size: int, epochs: Optional[int], steps: Optional[int], min_last: int, share: float = 1.0
) -> int:
    """The SGD steps of a training on n samples for ``epochs`` epochs or ``steps`` steps, a last batch of fewer
    than ``min_last`` samples skipped (:func:`plfl.batches.training_rows`' batches); with ``share`` < 1, epochs
    over max(1, ⌊share · n⌋) of the samples (ALA's s % sample)."""
    if share < 1:
        n = max(1, int(share * n))
    per_epoch = -(-epoch_size(n, batch_size, min_last) // batch_size)
    if not per_epoch:
        return 0
    return steps if steps is not None else epochs * per_epoch


class SampleLevelDP:
    """Each client's sample-level DP accountant (``privacy.level=sample``): one Opacus accountant per client,
    one step of DP-SGD's Gaussian mechanism (noise multiplier σ, sample rate q = B / n) per local step.

    Args:
        config: the ``privacy.*`` keys.
        noise_multiplier: σ (``privacy.noise_multiplier``, or :func:`noise_multiplier_for` the target ε).
        batch_size: B, ``federation.batch_size``.
        min_last: the fewest samples a last batch holds to be trained on.
    """

    def __init__(self, config: PrivacyConfig, noise_multiplier: float, batch_size: int, min_last: int):
        self.config, self.noise_multiplier = config, noise_multiplier
        self.batch_size, self.min_last = batch_size, min_last
        self.accountants: dict[int, Any] = {}
        self.epsilons: dict[int, float] = {}  # each client's ε since its last training (an accountant's ε is slow)

    @property
    def noise(self) -> DPSGDNoise:
        """What the executors read: σ and C."""
        return DPSGDNoise(self.noise_multiplier, self.config.max_grad_norm)

    def account(self, client_id: int, n: int, epochs: Optional[int], steps: Optional[int], share: float = 1.0) -> None:
        """A training of client ``client_id`` with n training samples for ``epochs`` epochs or ``steps`` steps, on
        a ``share`` of them (:func:`local_steps`); each step's sample rate is B / n all the same (a sample is in
        a given batch with that probability when the share is drawn at random)."""
        taken = local_steps(n, self.batch_size, epochs, steps, self.min_last, share)
        if not taken:
            return
        if client_id not in self.accountants:
            self.accountants[client_id] = new_accountant(self.config.accountant, "sample")
        rate = min(1.0, self.batch_size / n)
        self.epsilons.pop(client_id, None)
        for _ in range(taken):  # Opacus merges equal steps into one history entry
            self.accountants[client_id].step(noise_multiplier=self.noise_multiplier, sample_rate=rate)

    def epsilon(self, client_id: int) -> float:
        """ε of (ε, ``privacy.delta``)-DP of the client's training samples so far (0 before its first step)."""
        accountant = self.accountants.get(client_id)
        if accountant is None:
            return 0.0
        if client_id not in self.epsilons:
            self.epsilons[client_id] = float(accountant.get_epsilon(delta=self.config.delta))
        return self.epsilons[client_id]

    def round_metrics(self) -> dict[str, float]:
        """The largest client ε so far (``epsilon_max``)."""
        return {"epsilon_max": max(map(self.epsilon, self.accountants), default=0.0)}

    def summary(self, num_clients: int) -> dict[str, Any]:
        """The largest and mean ε of the ``num_clients`` clients, σ, δ and the accountant."""
        epsilons = [self.epsilon(c) for c in range(num_clients)]
        return {
            "epsilon_max": max(epsilons, default=0.0),
            "epsilon_mean": sum(epsilons) / len(epsilons) if epsilons else 0.0,
            "noise_multiplier": self.noise_multiplier,
            "delta": self.config.delta,
            "accountant": self.config.accountant,
        }

    def state_dict(self) -> dict[str, Any]:
        """Each client's accountant history: [σ, q, steps] entries."""
        return {c: [list(entry) for entry in a.history] for c, a in self.accountants.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.accountants, self.epsilons = {}, {}
        for client_id, history in state.items():
            accountant = self.accountants[client_id] = new_accountant(self.config.accountant, "sample")
            accountant.history = [tuple(entry) for entry in history]


def noise_multiplier_for(config: PrivacyConfig, trainings: set[tuple[float, int]]) -> float:
    """The σ at which every client reaches at most ``privacy.target_epsilon`` at ``privacy.delta``: the largest
    of Opacus' ``get_noise_multiplier`` (within its tolerance, 0.01) over ``trainings``, the distinct (sample
    rate q, local steps of the whole run) of the clients.

    Raises:
        ConfigError: Opacus is not installed.
    """
    new_accountant(config.accountant, "sample")  # the install hint, when Opacus is missing
    from opacus.accountants.utils import get_noise_multiplier

    return (
        max(
            get_noise_multiplier(
                target_epsilon=config.target_epsilon,
                target_delta=config.delta,
                sample_rate=rate,
                steps=steps,
                accountant=config.accountant,
            )
            for rate, steps in trainings
        )
        if trainings
        else config.noise_multiplier
    )  # no client takes a step: σ is never used


def new_accountant(name: str, level: str = "client") -> Any:
    """A fresh Opacus accountant: ``rdp`` (``RDPAccountant``, Rényi DP; Mironov, 2017) or ``prv``
    (``PRVAccountant``, privacy loss random variables; Gopi et al., NeurIPS 2021).

    Raises:
        ConfigError: Opacus is not installed.
    """
    try:
        from opacus.accountants import PRVAccountant, RDPAccountant  # only runs with privacy need Opacus
    except ImportError:
        raise ConfigError(
            f"privacy.level={level} accounts for ε with Opacus, which is not installed: pip install 'plfl[privacy]' "
            "(or set privacy.level=none)."
        ) from None
    return {"rdp": RDPAccountant, "prv": PRVAccountant}[name]()
