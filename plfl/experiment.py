"""From a validated config to a finished run directory."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
from omegaconf import DictConfig, OmegaConf
from torch import nn

from plfl.attacks import Attack, check_attack, check_images, flip_labels, plant_backdoor, triggered_test_clients
from plfl.batches import has_batch_norm, last_batch_minimum
from plfl.callbacks import Checkpoints, FederationCallback, RoundProgress, RunFiles, RunInfo, RunStart, WandbRun
from plfl.callbacks.files import write_atomically
from plfl.checkpoint import load_latest_checkpoint
from plfl.client_side import LocalClients, RemoteClients
from plfl.config import ExperimentConfig
from plfl.cpus import use_torch_threads
from plfl.data import FederatedData, load_federated_data
from plfl.data.federated import ClientData
from plfl.errors import ConfigError, PlflError
from plfl.executors import build_executor
from plfl.federation import FederationLoop
from plfl.methods import build_method, method_class
from plfl.methods.base import FederationContext, Method
from plfl.models import models
from plfl.privacy import ClientLevelDP, SampleLevelDP, local_steps, noise_multiplier_for
from plfl.seeding import clients_per_round, malicious_clients, unseen_clients
from plfl.state import ClientStateStore
from plfl.system import SystemSimulation


def run_experiment(
    cfg: DictConfig,
    resume: Optional[Path] = None,
    run_dir: Optional[Path] = None,
    callbacks: Sequence[FederationCallback] = (),
    remote: Optional[RemoteClients] = None,
) -> tuple[Path, dict[str, Any]]:
    """Load the data, build model, method and callbacks, and run the federation.

    Everything that can fail on bad input (data files, model/data mismatch,
    method options, the checkpoint to resume from) is checked before the run
    directory is created or, on resume or with ``run_dir``, written to.

    Args:
        cfg: a validated config (:func:`plfl.config.load_config`, or :func:`plfl.config.resume_config`).
        resume: a run directory to continue from its newest intact checkpoint
            (it must have been run with ``cfg``'s data, model and method).
        run_dir: the empty directory a new run writes to, made by the caller so that it is known before the run
            starts (``plfl sweep`` records its trials' directories); default: a new ``<output_dir>/<name>/<time>/``.
        callbacks: more callbacks, after those the config asks for (``plfl invert`` records an upload).
        remote: the clients' side in other processes (Flower's SuperNodes, :mod:`plfl.flower`): the data's shape
            and sample counts come from it, and every client's work goes to it; no executor is built here.

    Returns:
        The run directory (``<output_dir>/<name>/<time>/``, ``resume`` or ``run_dir``) and the summary.

    Raises:
        PlflError: bad data or config, or nothing to resume (nothing is written).
        FederationError: too many failed clients or a diverged global model; the
            run directory keeps the rounds so far, their last checkpoint, and a
            summary.json with ``status: failed`` and the error.
        Exception: any other failure during training, with the same files kept.
    """
    checkpoint = load_latest_checkpoint(resume / "checkpoints")[1] if resume else None
    if checkpoint is not None and checkpoint["round"] >= cfg.federation.rounds:
        raise PlflError(
            f"{resume} already finished round {checkpoint['round']} of federation.rounds="
            f"{cfg.federation.rounds}; to train longer, pass federation.rounds=N with N larger."
        )
    config: ExperimentConfig = OmegaConf.to_object(cfg)
    threads = use_torch_threads(config.federation.threads)
    # config.yaml records the count, so that a resumed run uses it: torch's CPU results depend on it in the last bits
    cfg = OmegaConf.merge(cfg, {"federation": {"threads": threads}})
    L.seed_everything(config.federation.seed, verbose=False)
    data = remote.federated_data() if remote else load_federated_data(config.data, config.federation.seed)
    if config.federation.drop_last:
        require_full_batches(data, config.federation.batch_size)
    model = models()[config.model.name].of(config.model).build(data.input_shape, data.num_classes, data.vocab_size)
    model = method_class(config.method.name).client_network(model)
    initial_params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    participants, unseen = hold_out(
        data, unseen_clients(config.federation.seed, len(data.clients), config.federation.unseen_clients)
    )
    attack, triggered = None, []
    if config.attack.kind != "none":  # before the method and the executors see the participants' data
        malicious = malicious_clients(config.federation.seed, len(participants.clients), config.attack.fraction)
        attack = Attack(config.attack, malicious, config.federation.seed)
        if config.attack.kind == "label_flip":
            participants = flip_labels(participants, malicious)
        if config.attack.kind == "backdoor":
            check_images(participants, config.attack.target)
            triggered = triggered_test_clients(participants, config.attack.target)
            participants = plant_backdoor(participants, malicious, config.attack, config.federation.seed)
    store = ClientStateStore(len(participants.clients))
    privacy = None
    if config.privacy.level == "client":
        num_clients = len(participants.clients)
        sampled = clients_per_round(num_clients, config.federation.join_ratio)
        privacy = ClientLevelDP(config.privacy, config.federation.seed, sampled, num_clients)
    dp_sgd = sample_level_dp(config, model) if config.privacy.level == "sample" else None
    context = FederationContext(
        participants, store, config.federation, model, config.data.augment, config.aggregation, privacy, dp_sgd
    )
    method = build_method(config.method, context, initial_params)
    if dp_sgd is not None and config.privacy.target_epsilon is not None:
        dp_sgd.noise_multiplier = target_noise_multiplier(dp_sgd, method, config.federation.rounds)
    check_attack(config.attack, method.name, method.uploads_model)
    if unseen and method.new_client_model(0) is None:
        raise ConfigError(
            f"method.name={method.name} has no model for a client that never took part, so it cannot evaluate "
            f"unseen clients (federation.unseen_clients={config.federation.unseen_clients}). Set "
            "federation.unseen_clients=0, or compare on unseen clients with a method that has a global model."
        )
    system = config.federation.system
    simulation = None
    if system.dropout or system.simulated or system.deadline is not None:
        num_train = [c.num_train for c in participants.clients]
        simulation = SystemSimulation(system, num_train, config.federation.batch_size, config.federation.seed)
    # The executor holds every client's data: the participants', then the unseen clients' (ids from N on), then,
    # with a backdoor, each participant's triggered test images (ids from N + U on).
    executor = (
        None
        if remote
        else build_executor(
            config.work if dp_sgd is None else dataclasses.replace(config.work, dp_sgd=dp_sgd.noise),
            config.executor_options,
            dataclasses.replace(data, clients=participants.clients + unseen + triggered),
            model,
        )
    )
    try:  # the executor's workers (Ray's actors) and the offload files go however the run ends, Ctrl+C included
        run_dir = resume or run_dir or new_run_dir(Path(cfg.output_dir) / cfg.name)
        write_atomically(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        run = RunInfo(cfg, run_dir, len(participants.clients), sum(p.numel() for p in model.parameters()))
        if config.federation.state_offload:
            context.store.offload(run_dir / "client-state")
        first_triggered = len(participants.clients) + len(unseen) if triggered else None
        clients = remote or LocalClients(method, store, executor, simulation, first_triggered)
        loop = FederationLoop(
            method, context, clients, [], run, unseen, config.eval.finetune_epochs, simulation, attack
        )
        if checkpoint is not None:
            loop.load_state_dict(checkpoint)
            del checkpoint  # with state_offload, its copy of the store would stay in memory all run
        loop.callbacks.extend(build_callbacks(cfg, loop.state_dict))
        loop.callbacks.extend(callbacks)
        return run_dir, loop.run()
    finally:
        context.store.close()  # the offload files: the checkpoints hold what a resumed run needs
        if executor is not None:
            executor.close()


def sample_level_dp(config: ExperimentConfig, model: nn.Module) -> SampleLevelDP:
    """The clients' sample-level DP (``privacy.level=sample``) at σ = ``privacy.noise_multiplier``; with
    ``privacy.target_epsilon``, :func:`target_noise_multiplier` sets σ once the method is built.

    Raises:
        ConfigError: a model with BatchNorm layers, whose per-sample gradients are not defined.
    """
    if has_batch_norm(model):
        raise ConfigError(
            f"privacy.level=sample clips each sample's gradient, which a BatchNorm layer of model.name="
            f"{config.model.name} does not have: it normalises each sample by its batch's statistics (Opacus refuses "
            "it too). Choose a model without BatchNorm (GroupNorm normalises each sample alone), or set "
            "privacy.level=none."
        )
    federation = config.federation
    min_last = last_batch_minimum(federation.batch_size, False, drop_last=federation.drop_last)
    return SampleLevelDP(config.privacy, config.privacy.noise_multiplier, federation.batch_size, min_last)


def target_noise_multiplier(dp_sgd: SampleLevelDP, method: Method, rounds: int) -> float:
    """The σ at which a client that trains in each of the ``rounds`` rounds, the most local steps ``method`` may
    take (:meth:`~plfl.methods.base.Method.private_steps`), reaches ``privacy.target_epsilon``: the largest over
    the clients (:func:`plfl.privacy.noise_multiplier_for`).

    Raises:
        ConfigError: Opacus is not installed.
    """

    def steps(n: int, length: dict[str, float]) -> int:  # one training's steps on n samples
        epochs, steps, share = length.get("epochs"), length.get("steps"), length.get("share", 1)
        return local_steps(n, dp_sgd.batch_size, epochs, steps, dp_sgd.min_last, share)

    trainings = set()
    for client in method.context.data.clients:
        if total := method.private_steps(functools.partial(steps, client.num_train), rounds):
            trainings.add((min(1.0, dp_sgd.batch_size / client.num_train), total))
    return noise_multiplier_for(dp_sgd.config, trainings)


def hold_out(data: FederatedData, unseen: list[int]) -> tuple[FederatedData, list[ClientData]]:
    """``data`` without the clients ``unseen`` (ids into ``data.clients``), the others keeping their order, and
    the held-out clients' data in the order of ``unseen``."""
    held = set(unseen)
    kept = [c for i, c in enumerate(data.clients) if i not in held]
    return dataclasses.replace(data, clients=kept), [data.clients[i] for i in unseen]


def require_full_batches(data: FederatedData, batch_size: int) -> None:
    """Raises ConfigError when a client holds fewer training samples than ``batch_size``: with
    ``federation.drop_last`` it would have no batch to train on."""
    short = [(i, c.num_train) for i, c in enumerate(data.clients) if c.num_train < batch_size]
    if short:
        client, n = short[0]
        raise ConfigError(
            f"federation.drop_last=true leaves {len(short)} client(s) without a full batch of "
            f"federation.batch_size={batch_size} (client {client} holds {n} training samples). Lower "
            f"federation.batch_size to {min(n for _, n in short)} or set federation.drop_last=false."
        )


def build_callbacks(cfg: DictConfig, state: Callable[[], dict[str, Any]]) -> list[FederationCallback]:
    """The callbacks the config asks for: result files always, W&B and the progress bar on request,
    and checkpoints of ``state()`` unless ``checkpoint_every`` is 0 (last, after the result files)."""
    callbacks: list[FederationCallback] = [RunStart(), RunFiles(metrics=cfg.logger.name != "none")]
    if cfg.logger.name == "wandb":
        callbacks.append(WandbRun(cfg.logger.project, cfg.logger.entity, cfg.logger.verbose))
    if cfg.progress_bar:
        callbacks.append(RoundProgress())
    if cfg.checkpoint_every:
        callbacks.append(Checkpoints(state, cfg.checkpoint_every, cfg.keep_checkpoints))
    return callbacks


def new_run_dir(parent: Path) -> Path:
    """A fresh ``parent/<YYYYmmdd-HHMMSS>[-k]`` directory (``-k`` when the second is taken)."""
    parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for k in range(1000):
        path = parent / (stamp if k == 0 else f"{stamp}-{k}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new run directory under {parent}")
