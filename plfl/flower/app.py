"""A plfl config as a Flower app: a ServerApp that runs plfl's federation loop with the method's server side, and a
ClientApp that answers for its SuperNode's clients (:mod:`plfl.flower.node`).

:func:`server_app` and :func:`client_app` build the two for a config; ``flwr run`` loads the module-level
``server`` and ``client``, which read theirs from the Flower run config: ``config`` (a plfl YAML path), ``nodes``
(the SuperNodes to wait for) and optionally ``overrides`` (``key=value`` pairs separated by spaces). The server
writes the run directory as ``plfl fit`` does; the nodes write nothing.

What a Flower run refuses (:func:`check_flower`) is what only a simulation has: unseen clients, simulated client
systems, poisoned clients, sample-level DP (its accountant runs on the server), and the Ray executor (a node runs
its clients itself, on the sequential or vectorized executor).
"""

from __future__ import annotations

import shlex
from typing import Any, Optional

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from omegaconf import DictConfig, OmegaConf

from plfl.config import ExperimentConfig, load_config
from plfl.cpus import use_torch_threads
from plfl.errors import ConfigError
from plfl.experiment import run_experiment
from plfl.flower.node import Node
from plfl.flower.server import FlowerClients


def check_flower(cfg: DictConfig) -> None:
    """Refuse what a Flower run does not do.

    Raises:
        ConfigError: ``federation.unseen_clients``, ``federation.system``, ``attack.kind``, ``privacy.level=sample``
            or ``federation.executor=ray``, each with the fix.
    """
    config: ExperimentConfig = OmegaConf.to_object(cfg)
    federation, system = config.federation, config.federation.system
    refused = {
        "federation.unseen_clients": (federation.unseen_clients, 0),
        "federation.system.dropout": (system.dropout, 0.0),
        "federation.system.simulated": (system.simulated, False),
        "federation.system.deadline": (system.deadline, None),
        "attack.kind": (config.attack.kind, "none"),
    }
    for key, (value, plain) in refused.items():
        if value != plain:
            raise ConfigError(
                f"{key}={value} is simulated in one process; on Flower's SuperNodes the clients are real. Set "
                f"{key}={plain} for plfl flower, or run it with plfl fit."
            )
    if config.privacy.level == "sample":
        raise ConfigError(
            "privacy.level=sample accounts each client's ε where its DP-SGD steps run, which a Flower run does not "
            "bring back to the server yet. Use privacy.level=client (the server's DP-FedAvg), or plfl fit."
        )
    if federation.executor == "ray":
        raise ConfigError(
            "federation.executor=ray spreads clients over a Ray cluster; on Flower each SuperNode runs its own "
            "clients. Set federation.executor=sequential (or vectorized on a node with a GPU)."
        )


def run_config(context: Context) -> DictConfig:
    """The plfl config a ``flwr run`` names: ``config`` (YAML path) with ``overrides``."""
    values = context.run_config
    if "config" not in values:
        raise ConfigError(
            "The Flower run config has no 'config': set it to a plfl YAML in the app's pyproject.toml "
            "([tool.flwr.app.config] config = 'configs/fedavg.yaml') or flwr run --run-config \"config='...'\"."
        )
    return load_config(str(values["config"]), shlex.split(str(values.get("overrides", ""))))


def server_app(
    cfg: Optional[DictConfig] = None, nodes: Optional[int] = None, outcome: Optional[dict] = None
) -> ServerApp:
    """The ServerApp of ``cfg`` over ``nodes`` SuperNodes (None: the run config's); the run's directory and
    summary (or the error that ended it) go into ``outcome``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            config = cfg if cfg is not None else run_config(context)
            check_flower(config)
            clients = FlowerClients(grid, nodes if nodes is not None else int(context.run_config["nodes"]))
            run_dir, summary = run_experiment(config, remote=clients)
            if outcome is not None:
                outcome.update(run_dir=run_dir, summary=summary)
        except BaseException as error:
            if outcome is None:
                raise
            outcome["error"] = error

    return app


_nodes: dict[tuple[int, int], Node] = {}  # (run, node) → its clients, built at the node's first request


def client_app(cfg: Optional[DictConfig] = None) -> ClientApp:
    """The ClientApp of ``cfg`` (None: the run config's)."""
    app = ClientApp()

    def handle(message: Message, context: Context) -> Message:
        key = (context.run_id, context.node_id)
        if key not in _nodes:
            config = cfg if cfg is not None else run_config(context)
            use_torch_threads(config.federation.threads)
            _nodes[key] = Node(config, dict(context.node_config))
        return _nodes[key].handle(message, context)

    requests = (app.query("describe"), app.query("initialise"), app.train(), app.evaluate(), app.evaluate("models"))
    for register in requests:
        register(handle)
    return app


server = server_app()
client = client_app()


def run_simulation(cfg: DictConfig, nodes: int, backend: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Run ``cfg`` in Flower's simulation runtime over ``nodes`` SuperNodes (``backend``: its backend config, e.g.
    ``{"client_resources": {"num_cpus": 1}}``). Returns ``run_dir`` and ``summary``.

    Raises:
        ConfigError: what :func:`check_flower` refuses.
        PlflError, FederationError: as :func:`plfl.experiment.run_experiment`.
    """
    from flwr.simulation import run_simulation as flower_simulation

    check_flower(cfg)
    outcome: dict[str, Any] = {}
    flower_simulation(server_app(cfg, nodes, outcome), client_app(cfg), nodes, backend_config=backend)
    if "error" in outcome:
        raise outcome["error"]
    return outcome
