"""A plfl config as a Flower app: a ServerApp that runs plfl's federation loop with the method's server side, and a
ClientApp that answers for its SuperNode's clients (:mod:`plfl.flower.node`).

:func:`server_app` and :func:`client_app` build the two for a config; ``flwr run`` loads the module-level
``server`` and ``client``, which read theirs from the Flower run config: ``config`` (a plfl YAML path), ``nodes``
(the SuperNodes to wait for) and optionally ``overrides`` (``key=value`` pairs separated by spaces), ``resume`` (a
run directory to continue) and ``timeout`` (seconds to wait for a request's replies). The server writes the run
directory as ``plfl fit`` does; a node writes only its clients' state, with a state directory.

What a Flower run refuses (:func:`check_flower`) is what only a simulation has: unseen clients, simulated client
systems, poisoned clients, sample-level DP (its accountant runs on the server), and the Ray executor (a node runs
its clients itself, on the sequential or vectorized executor).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from omegaconf import DictConfig, OmegaConf

from plfl.checkpoint import load_latest_checkpoint
from plfl.config import ExperimentConfig, load_config, resume_config, validate
from plfl.cpus import use_torch_threads
from plfl.errors import ConfigError
from plfl.experiment import new_run_dir, run_experiment
from plfl.flower.node import Node
from plfl.flower.records import config_of
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


def run_config(context: Context) -> tuple[DictConfig, Optional[Path]]:
    """The plfl config a ``flwr run`` names, and the run directory it resumes (None: a new run): ``resume`` (a run
    directory: its config.yaml) or ``config`` (a YAML path), with ``overrides``.

    Raises:
        ConfigError: neither key, or what :func:`plfl.config.load_config` (:func:`~plfl.config.resume_config`)
            raises.
    """
    values = context.run_config
    overrides = shlex.split(str(values.get("overrides", "")))
    if values.get("resume"):
        return resume_config(Path(str(values["resume"])), overrides), Path(str(values["resume"]))
    if "config" not in values:
        raise ConfigError(
            "The Flower run config has no 'config': set it to a plfl YAML in the app's pyproject.toml "
            "([tool.flwr.app.config] config = 'configs/fedavg.yaml') or flwr run --run-config \"config='...'\"."
        )
    return load_config(str(values["config"]), overrides), None


def server_app(
    cfg: Optional[DictConfig] = None,
    nodes: Optional[int] = None,
    run_dir: Optional[Path] = None,
    resume: Optional[Path] = None,
    outcome: Optional[dict] = None,
) -> ServerApp:
    """The ServerApp of ``cfg`` over ``nodes`` SuperNodes, writing the new ``run_dir`` or continuing ``resume`` (None:
    the Flower run config's ``config``, ``nodes``, ``resume`` and ``timeout``, the seconds to wait for a request's
    replies); the run's directory and summary (or the error that ended it) go into ``outcome``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            values = context.run_config
            config, resumed = (cfg, resume) if cfg is not None else run_config(context)
            check_flower(config)
            round_ = load_latest_checkpoint(resumed / "checkpoints")[1]["round"] if resumed else None
            timeout = float(values["timeout"]) if values.get("timeout") else None
            num_nodes = nodes if nodes is not None else int(values["nodes"])
            clients = FlowerClients(grid, num_nodes, timeout, resume=round_, config=config)
            directory, summary = run_experiment(config, resumed, run_dir, remote=clients)
            if outcome is not None:
                outcome.update(run_dir=directory, summary=summary)
        except BaseException as error:
            if outcome is None:
                raise
            outcome["error"] = error

    return app


_nodes: dict[tuple[int, int], Node] = {}  # (run, node) → its clients, built at the node's first request
SENT_CONFIG = "plfl-config"


def client_app(cfg: Optional[DictConfig] = None, state_root: Optional[Path] = None) -> ClientApp:
    """The ClientApp of ``cfg`` (None: the config the server sends with its first request, kept in the node's
    context); a node without ``state-dir`` in its node config keeps its clients' state in
    ``state_root``/node-``partition-id`` (None: in its Flower context only)."""
    app = ClientApp()

    def handle(message: Message, context: Context) -> Message:
        key = (context.run_id, context.node_id)
        if key not in _nodes:  # a deployed SuperNode starts a new process for each message
            config = cfg if cfg is not None else sent_config(message, context)
            use_torch_threads(config.federation.threads)
            _nodes[key] = Node(config, dict(context.node_config), state_root)
        return _nodes[key].handle(message, context)

    requests = (app.query("describe"), app.query("initialise"), app.train(), app.evaluate(), app.evaluate("models"))
    for register in requests:
        register(handle)
    return app


def write_app(
    directory: Path, config: Path, nodes: int, timeout: Optional[float] = None, overrides: Sequence[str] = ()
) -> Path:
    """A Flower app for ``flwr run`` in ``directory``: its ``pyproject.toml`` names plfl's ServerApp and ClientApp and
    holds the run config (``config``, the YAML's absolute path; ``nodes``; ``timeout``, seconds, 0: none;
    ``overrides``). Its dependencies are empty: plfl and Flower are installed where the SuperLink and SuperNodes run
    (start the SuperLink with ``--disable-runtime-dependency-installation``). Returns the file.
    """
    directory.mkdir(parents=True, exist_ok=True)
    values = {
        "config": str(config.resolve()),
        "nodes": nodes,
        "timeout": float(timeout or 0),
        "overrides": " ".join(shlex.quote(o) for o in overrides),
        "resume": "",
    }
    lines = [
        "# A plfl run as a Flower app: flwr run . CONNECTION --stream (see plfl's Flower how-to)",
        "[project]",
        'name = "plfl-app"',
        'version = "1.0.0"',
        "dependencies = []",
        "",
        "[tool.flwr.app]",
        'publisher = "plfl"',
        "",
        "[tool.flwr.app.components]",
        'serverapp = "plfl.flower.app:server"',
        'clientapp = "plfl.flower.app:client"',
        "",
        "[tool.flwr.app.config]",
        *(f"{key} = {json.dumps(value)}" for key, value in values.items()),
    ]
    path = directory / "pyproject.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def sent_config(message: Message, context: Context) -> DictConfig:
    """The run's config as the server sent it (``query.describe``), kept in ``context.state`` for the node's later
    requests.

    Raises:
        ConfigError: a request before the server's first, or a config this plfl does not validate.
    """
    request = config_of(message.content)
    if "config" in request:
        context.state[SENT_CONFIG] = ConfigRecord({"yaml": request["config"]})
    if SENT_CONFIG not in context.state:
        raise ConfigError("this SuperNode got a request before the server sent the run's config (query.describe)")
    return validate(OmegaConf.create(context.state[SENT_CONFIG]["yaml"]))


server = server_app()
client = client_app()


def run_simulation(
    cfg: DictConfig, nodes: int, backend: Optional[dict[str, Any]] = None, resume: Optional[Path] = None
) -> dict[str, Any]:
    """Run ``cfg`` in Flower's simulation runtime over ``nodes`` SuperNodes (``backend``: its backend config, e.g.
    ``{"client_resources": {"num_cpus": 1}}``), or continue the run in ``resume`` from its newest checkpoint (with
    ``cfg`` from :func:`plfl.config.resume_config`). The simulated nodes keep their clients' state in the run
    directory's ``node-state/node-K``. Returns ``run_dir`` and ``summary``.

    Raises:
        ConfigError: what :func:`check_flower` refuses.
        PlflError, FederationError: as :func:`plfl.experiment.run_experiment`.
    """
    from flwr.simulation import run_simulation as flower_simulation

    check_flower(cfg)
    run_dir = resume or new_run_dir(Path(cfg.output_dir) / cfg.name)
    outcome: dict[str, Any] = {}
    server_side = server_app(cfg, nodes, None if resume else run_dir, resume, outcome)
    flower_simulation(server_side, client_app(cfg, run_dir / "node-state"), nodes, backend_config=backend)
    if "error" in outcome:
        raise outcome["error"]
    return outcome
