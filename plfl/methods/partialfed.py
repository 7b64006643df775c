"""PartialFed (Sun, Huo, Yang and Bai, NeurIPS 2021, openreview lgDP84byd5): partial initialisation, layer by layer.

Each round a client starts local training from a *partial initialisation*: a loading strategy decides,
per layer, whether the layer comes from the received global model θ_t or stays the client's own
θ^c_{t−1}; the server averages the uploads as FedAvg does. Two strategies (``method.strategy``):

- **Fix** (the paper's PartialFed-Fix): the layers named in ``method.local_layers`` (module names, or
  the shorthands ``head`` and ``bn``: every BatchNorm layer) stay local, the rest load from the global
  model. It is :class:`~plfl.methods.partial.PartialSharing` with those keys local: they are neither
  sent nor averaged. The paper found bottom layers global and top layers local better than the
  reverse, every partial strategy better than FedAvg's full loading, and local BatchNorm layers and a
  local classifier helpful; the default keeps the head and the BatchNorm layers local.
- **Adaptive** (PartialFed-Adaptive): each client learns its own strategy. **This rule is plfl's
  reconstruction**: the paper's update rule and its defaults could not be read, and no official code
  exists. Per client c and layer i (a module with parameters, its parameters and floating buffers):
  logits β^c_i ∈ ℝ² (0: load global, 1: keep local), (0, 0) at first, kept in the client's state;
  at each local initialisation α^c_i = softmax((β^c_i + g)/τ_r) with Gumbel noise g drawn per client and
  round (stream "partial_strategy") and θ_init[i] = α_{i,0} θ_t[i] + α_{i,1} θ^c_{t−1}[i] (``pre_local_init``);
  in local training (``local_train``) θ trains as usual from θ_init on all but a held-back
  ``strategy_fraction`` of the client's samples (drawn per client and round), while β takes
  gradient steps (``strategy_lr``) on the cross-entropy of the mixed model on the held-back samples,
  θ_t and θ^c_{t−1} fixed (:class:`StrategyStep`, ALA's pattern: the mix is a function of β only);
  τ_r = τ_0 · d^r (``tau0``, ``tau_decay``), straight-through arg-max choices once τ_r < ``hard_below`` with
  ``hard``; the first ``warmup_rounds`` are plain FedAvg. The mix with Gumbel-Softmax, τ 5 decaying by
  0.965 per round, the 20 % held-back batches and 20 warm-up rounds follow the only code trace (a
  PFLlib file removed in 2022, never working); holding back a random 20 % of the samples per round
  instead of the last 20 % of each epoch's batches, the learning rate and the floating buffers' mix
  are plfl's choices. The strategy's per-layer mean probability of loading the global layer is
  reported each round (``round_tables``: ``partialfed_strategy``; ``round_metrics``).

FedALA's Table 4 adds ALA (p = 1) to PartialFed, for a gain of 0.14 pp (Tiny-ImageNet) and 0.18 pp
(CIFAR-100). With ``method.ala`` ALA refines the partial initialisation, taking it as the received model
(:class:`~plfl.methods.ala.AdaptiveLocalAggregation`); under Fix its top p tensors must reach a layer loaded
from the global model, since on a local layer the initialisation is the client's own model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.func import grad_and_value
from torch.nn.modules.batchnorm import _BatchNorm

from plfl.errors import ConfigError
from plfl.fields import checked, one_of
from plfl.methods.ala import top_names
from plfl.methods.base import FederationContext, require_private_steps
from plfl.methods.fedavg import FedAvgConfig
from plfl.methods.partial import PartialSharing, module_keys
from plfl.plots import TableLines
from plfl.seeding import derive_seed
from plfl.state import Params
from plfl.tasks import (
    Batch,
    Network,
    Step,
    StepOutput,
    TrainResult,
    Work,
    masked_cross_entropy,
    sample_count,
)

STRATEGY = "partialfed_strategy"  # store key: the client's β, layer → (2,) logits
PREVIOUS = "partialfed_previous"  # store key: θ^c_{t−1}, the client's model before its last initialisation
# The keys only one strategy reads.
STRATEGY_KEYS = {
    "fix": ("local_layers",),
    "adaptive": ("strategy_fraction", "strategy_lr", "tau0", "tau_decay", "hard", "hard_below", "warmup_rounds"),
}


@dataclass
class PartialFedConfig(FedAvgConfig):
    """PartialFed's keys; Adaptive's rule and defaults are plfl's reconstruction (see the module docstring).

    Raises:
        ConfigError: a key of one strategy set with the other.
    """

    strategy: str = one_of("fix", ("fix", "adaptive"), "fix: the local_layers stay local; adaptive: learned per client")
    local_layers: list[str] = field(
        default_factory=lambda: ["head", "bn"],
        metadata={"doc": "fix: module names (or head, bn: every BatchNorm layer) kept local; the rest is global"},
    )
    strategy_fraction: float = checked(
        0.2, lambda v: 0 < v < 1, "a number in (0, 1)", "adaptive: share of a client's samples that trains β"
    )
    strategy_lr: float = checked(1.0, lambda v: v > 0, "a number > 0", "adaptive: step size of β")
    tau0: float = checked(5.0, lambda v: v > 0, "a number > 0", "adaptive: the Gumbel-Softmax temperature at round 0")
    tau_decay: float = checked(0.965, lambda v: 0 < v <= 1, "a number in (0, 1]", "adaptive: τ's factor per round")
    hard: bool = field(default=False, metadata={"doc": "adaptive: straight-through arg-max once τ < hard_below"})
    hard_below: float = checked(1.0, lambda v: v > 0, "a number > 0", "adaptive: τ below which hard choices start")
    warmup_rounds: int = checked(
        20, lambda v: v >= 0, "an integer >= 0", "adaptive: rounds of plain FedAvg before strategies are used"
    )

    def __post_init__(self) -> None:
        other = "fix" if self.strategy == "adaptive" else "adaptive"
        for f in dataclasses.fields(self):
            if f.name in STRATEGY_KEYS[other] and getattr(self, f.name) != _default(f):
                raise ConfigError(
                    f"method.{f.name} is read only by method.strategy={other}, not by method.strategy={self.strategy}. "
                    f"Remove method.{f.name} or set method.strategy={other}."
                )


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def layer_keys(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Layer name → its ``state_dict`` keys: a layer is a module with parameters of its own (its parameters and
    buffers), in the model's order."""
    owners = {
        name for name, module in model.named_modules() if next(module.parameters(recurse=False), None) is not None
    }
    layers: dict[str, list[str]] = {}
    for key in model.state_dict():
        owner = key.rpartition(".")[0]
        if owner in owners:
            layers.setdefault(owner, []).append(key)
    return {layer: tuple(keys) for layer, keys in layers.items()}


def relaxed(beta: torch.Tensor, noise: torch.Tensor, tau: float, hard: bool) -> torch.Tensor:
    """α = softmax((β + g)/τ), (2,): the Gumbel-Softmax relaxation of the choice (global, local); with ``hard``
    the one-hot arg-max with α's gradient (straight-through)."""
    soft = torch.softmax((beta + noise) / tau, dim=-1)
    if not hard:
        return soft
    return (soft >= soft.max()).to(soft.dtype) - soft.detach() + soft


def mixed(
    layers: dict[str, tuple[str, ...]], alphas: dict[str, torch.Tensor], global_params: Params, local: Params
) -> Params:
    """θ[i] = α_{i,0} θ_t[i] + α_{i,1} θ^c_{t−1}[i] per floating tensor of each layer i; integer buffers local."""
    return {
        key: alphas[layer][0] * global_params[key] + alphas[layer][1] * local[key]
        if local[key].is_floating_point()
        else local[key]
        for layer, keys in layers.items()
        for key in keys
    }


@dataclass(frozen=True)
class StrategyStep(Step):
    """One gradient step of the clients' logits β (the state: layer → (2,)) on the cross-entropy of the model
    whose ``layers``' parameters are mixed from the shared received model and the inputs ``local/<key>``
    (θ^c_{t−1}) with this participation's Gumbel noise ``noise/<layer>``; the weights stay fixed."""

    work = "PartialFed's strategy"
    layers: tuple[tuple[str, tuple[str, ...]], ...]
    lr: float
    tau: float
    hard: bool

    def __call__(self, network: Network, state: Params, inputs: Params, shared: Params, batch: Batch) -> StepOutput:
        layers = dict(self.layers)
        local = {key: inputs[f"local/{key}"] for keys in layers.values() for key in keys}

        def loss(beta: Params) -> torch.Tensor:
            alphas = {layer: relaxed(beta[layer], inputs[f"noise/{layer}"], self.tau, self.hard) for layer in layers}
            logits, _ = network({**shared, **mixed(layers, alphas, shared, local)}, batch.x, batch.mask)
            return masked_cross_entropy(logits, batch.y, batch.mask)

        grads, value = grad_and_value(loss)(state)
        return StepOutput({k: v - self.lr * grads[k] for k, v in state.items()}, value, sample_count(batch))


class PartialFed(PartialSharing):
    """PartialFed (Sun et al., NeurIPS 2021): layers loaded from the global model or kept local, fixed or learned.

    Fix: FedAvg on every key outside ``local_layers``. Adaptive: FedAvg on the whole model; each client's
    initialisation mixes each layer of the global and its own model by its learned strategy.
    """

    name = "partialfed"
    config_class = PartialFedConfig
    figures = (
        TableLines(
            "PartialFed: probability of loading each layer from the global model",
            STRATEGY,
            group="layer",
            y="global_probability",
            y_title="probability",
            y_range=(0.0, 1.0),
            group_label="layer {}",
        ),
    )
    # The executor matrix: the learned strategy, past its warm-up.
    matrix_options = {"method.strategy": "adaptive", "method.warmup_rounds": 1}

    def __init__(self, config: PartialFedConfig, context: FederationContext, initial_params: Params):
        super().__init__(config, context, initial_params)
        self.adaptive = config.strategy == "adaptive"
        if self.adaptive:
            require_private_steps(
                "partialfed",
                context,
                "learns the adaptive strategy's logits in steps of its own (method.strategy=adaptive)",
            )
        self.layers = layer_keys(context.architecture)
        parameters = {name for name, _ in context.architecture.named_parameters()}
        ala = config.ala
        if ala is not None and set(top_names(context.architecture, ala.p)) <= self.local_keys:
            raise ConfigError(
                f"method.ala.p={ala.p} lets ALA aggregate only tensors that method.local_layers keeps local, "
                "where the received model equals the client's own: ALA would change nothing. Raise method.ala.p "
                "until it reaches a layer loaded from the global model, or set method.strategy=adaptive."
            )
        # What the strategy's loss mixes: the parameters (in training mode BatchNorm's output ignores its statistics).
        self.parameter_layers = {
            layer: tuple(k for k in keys if k in parameters) for layer, keys in self.layers.items()
        }

    def keep_local(self, model: nn.Module) -> frozenset[str]:
        """Fix: the keys of the ``local_layers``; Adaptive: none (the strategy decides per client).

        Raises:
            ConfigError: a name in ``local_layers`` that is no module of the model, or none that selects a key.
        """
        if self.config.strategy == "adaptive":
            return frozenset()
        names = {name for name, _ in model.named_modules() if name}
        unknown = [n for n in self.config.local_layers if n not in names | {"bn"}]
        if unknown:
            raise ConfigError(
                f"method.local_layers names {unknown}, which are no modules of model; use bn, or some "
                f"of: {', '.join(sorted(names))}."
            )
        wanted = set(self.config.local_layers)
        return module_keys(
            model, lambda name, module: name in wanted or ("bn" in wanted and isinstance(module, _BatchNorm))
        )

    def pre_local_init(self, client_id: int, message: Params, round_: int) -> Params:
        """Fix: the received keys over the client's local layers. Adaptive (from round ``warmup_rounds`` on,
        for a client with a model): every layer mixed by α from the client's β; before, the received model."""
        own = self.store.get(client_id, "model")
        if not self.adaptive:
            return super().pre_local_init(client_id, message, round_)
        if own is None or round_ < self.config.warmup_rounds:
            return {k: v.clone() for k, v in message.items()}
        self.store.set(client_id, PREVIOUS, own)
        noise, _ = self.draws(client_id, round_)
        alphas = {
            layer: relaxed(beta, noise[layer], self.tau(round_), self.hard(round_))
            for layer, beta in self.strategy(client_id).items()
        }
        return {**message, **mixed(self.layers, alphas, message, own)}

    def local_train(self, client_id: int, params: Params, message: Optional[Params], round_: int) -> Work[TrainResult]:
        """Adaptive after the warm-up: θ trains on all but the held-back samples while β learns on them (one
        request of both tasks); otherwise FedAvg's training."""
        previous = self.store.get(client_id, PREVIOUS)
        if not self.adaptive or round_ <= self.config.warmup_rounds or previous is None:
            return (yield from super().local_train(client_id, params, message, round_))
        noise, (train, held) = self.draws(client_id, round_ - 1)  # the draws of this initialisation
        step = StrategyStep(
            tuple(self.parameter_layers.items()), self.config.strategy_lr, self.tau(round_ - 1), self.hard(round_ - 1)
        )
        inputs = {
            **{f"local/{k}": previous[k] for keys in self.parameter_layers.values() for k in keys},
            **{f"noise/{layer}": g for layer, g in noise.items()},
        }
        trained, learned = yield [
            self.train_task(
                client_id, params, round_, "local_training", **self.context.federation.local_length(), samples=train
            ),
            self.step_task(
                client_id,
                step,
                self.strategy(client_id),
                round_,
                "partial_strategy",
                inputs=inputs,
                shared=message,
                ordered_samples=held,
                # The held-back samples are visited whole: epochs, also when training counts steps.
                epochs=self.context.federation.local_epochs or 1,
            ),
        ]
        self.store.set(client_id, STRATEGY, learned.state)
        return trained

    def draws(self, client_id: int, round_: int) -> tuple[Params, tuple[torch.Tensor, torch.Tensor]]:
        """The Gumbel noise of the initialisation at ``round_``'s broadcast (layer → (2,)) and the split of the
        client's training samples for the training that follows (training, held-back indices, sorted)."""
        generator = torch.Generator().manual_seed(derive_seed(self.seed, round_, client_id, "partial_strategy"))
        uniform = torch.rand(len(self.layers), 2, generator=generator).clamp(1e-20, 1 - 1e-7)
        noise = dict(zip(self.layers, -torch.log(-torch.log(uniform))))
        n = self.context.data.clients[client_id].num_train
        order = torch.randperm(n, generator=generator)
        held = max(1, int(self.config.strategy_fraction * n)) if n > 1 else 0
        return noise, (order[held:].sort().values, order[:held].sort().values)

    def strategy(self, client_id: int) -> Params:
        """The client's β: layer → (2,) logits, zeros before it learned any."""
        return self.store.get(client_id, STRATEGY) or {layer: torch.zeros(2) for layer in self.layers}

    def tau(self, round_: int) -> float:
        return self.config.tau0 * self.config.tau_decay**round_

    def hard(self, round_: int) -> bool:
        return self.config.hard and self.tau(round_) < self.config.hard_below

    def global_probabilities(self, round_: int) -> dict[str, float]:
        """Layer → the mean over clients of softmax(β/τ)_0, the probability of loading it from the global model."""
        probabilities = [
            {layer: torch.softmax(beta / self.tau(round_), -1)[0].item() for layer, beta in self.strategy(i).items()}
            for i in range(len(self.store))
        ]
        return {layer: sum(p[layer] for p in probabilities) / len(probabilities) for layer in self.layers}

    def round_metrics(self, round_: int) -> dict[str, float]:
        """Adaptive: ``strategy_global_mean``, the mean over layers of :meth:`global_probabilities`."""
        metrics = super().round_metrics(round_)
        if self.adaptive and round_ >= self.config.warmup_rounds:
            probabilities = self.global_probabilities(round_)
            metrics["strategy_global_mean"] = sum(probabilities.values()) / len(probabilities)
        return metrics

    def round_tables(self, round_: int) -> dict[str, list[dict[str, Any]]]:
        """Adaptive: ``partialfed_strategy``, per layer the mean probability of loading it from the global model."""
        if not self.adaptive or round_ < self.config.warmup_rounds:
            return {}
        return {
            STRATEGY: [
                {"layer": layer, "global_probability": p} for layer, p in self.global_probabilities(round_).items()
            ]
        }
