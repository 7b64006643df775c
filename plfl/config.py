"""Typed experiment configuration: schemas, loading, overrides and validation.

A config is one YAML file plus ``key=value`` dot-list overrides (OmegaConf), checked against the schemas
before anything trains: the sections every run has (:mod:`plfl.sections`, ``logger.*``, the top-level keys) and
the sections that plfl's parts declare beside the code that reads them: ``data.*`` (every data source's and
partition's keys, :mod:`plfl.data.sources`), ``model.*`` (every model's, :mod:`plfl.models`), the executors'
own sections (:mod:`plfl.executors.options`) and ``method.*`` (the named method's config, its module in
:mod:`plfl.methods`). A key that the chosen source, partition, model or executor does not read is refused unless
it holds its default, with who reads it. Every check runs before torch is imported, the method section's against
the method's config class rebuilt from its module's source; only then is the module itself imported (torch with
it), last, for what the rebuilt class cannot check (a ``__post_init__``).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from plfl.data.partition import partitions
from plfl.data.sources import DataConfig, data_sources
from plfl.errors import ConfigError, PlflError
from plfl.executors.options import ClientWorkOptions, ExecutorOptions, Ray, Vectorized, executors
from plfl.fields import Component, allowed, as_yaml, checked, default_of, documented, key_names, one_of, readers
from plfl.methods import method_class, source_config_class
from plfl.models import ModelConfig, models
from plfl.sections import (
    AggregationConfig,
    AttackConfig,
    EvalConfig,
    FederationConfig,
    PrivacyConfig,
    TrainerConfig,
)

LOGGERS = ("csv", "wandb", "none")
# Sections a ``SECTION=NAME`` override replaces with the defaults of the component NAME (the method, the model).
SWITCHED = ("method", "model")
# Keys that moved to the section of the part that reads them: old key → new key. A saved config (a run
# directory's config.yaml) holds them at their defaults, which are dropped; another value is refused, naming
# the new key.
MOVED = {"federation.cohort_size": "vectorized.cohort_size", "federation.cuda_graphs": "vectorized.cuda_graphs"}


@dataclass
class LoggerConfig:
    """Where metrics go besides the console (``logger.*``).

    ``csv`` writes metrics.csv and clients.csv in the run directory; ``wandb``
    does that and logs to Weights & Biases; ``none`` writes no metrics files,
    only config.yaml, summary.json and the checkpoints.
    """

    name: str = one_of(
        "csv",
        LOGGERS,
        "csv: result files in the run directory; wandb: those and Weights & Biases; none: no metrics files, only "
        "config.yaml, summary.json and the checkpoints",
    )
    project: str = documented("plfl", "wandb: the W&B project")
    entity: Optional[str] = documented(None, "wandb: the W&B entity (null: the account's default)")
    verbose: bool = documented(False, "wandb: show W&B's own banners and notices (false: plfl's output only)")


@dataclass
class ExperimentConfig:
    """The whole experiment; ``method`` is checked by the named method's own schema."""

    name: Optional[str] = documented(
        None, "run name: the run directory is <output_dir>/<name>/<time>/ (null: <method>-<data source>)"
    )
    output_dir: str = documented("runs", "where run directories are made")
    progress_bar: bool = documented(True, "a progress bar with ETA on stderr")
    checkpoint_every: int = checked(
        1,
        lambda v: v >= 0,
        "an integer >= 0",
        "save the federation's state every this many rounds and after the last (0: never); plfl fit --resume",
    )
    keep_checkpoints: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "null or an integer >= 1",
        "the newest checkpoints kept on disk; null: 2 while the run goes (a damaged newest leaves the one before), "
        "the last one alone once it completed",
    )
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: Any = documented(
        doc="the method (method.name, one of plfl methods) and its own keys", default_factory=lambda: {"name": "fedavg"}
    )
    federation: FederationConfig = field(default_factory=FederationConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    vectorized: Vectorized = field(default_factory=Vectorized)
    ray: Ray = field(default_factory=Ray)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def work(self) -> ClientWorkOptions:
        """What the executors read of this config."""
        return ClientWorkOptions(self.federation, self.trainer, self.data.augment)

    @property
    def executor_options(self) -> ExecutorOptions:
        """The chosen executor's keys: its section (``vectorized``, ``ray``), or none."""
        name = self.federation.executor
        return getattr(self, name) if any(f.name == name for f in dataclasses.fields(self)) else executors()[name]()


def load_config(path: str | Path | None, overrides: list[str] = ()) -> DictConfig:
    """Read a YAML config, apply dot-list overrides and validate the result.

    ``method=NAME`` (``model=NAME``) among the overrides replaces the method (model) section with method (model)
    NAME's defaults; overrides after it still apply. One config serves every method and model.

    Returns the resolved, validated config as a DictConfig (``${...}`` resolved,
    ``data.root``, a local ``data.path`` and ``federation.system.trace`` made absolute, the method section
    filled with its defaults).

    Raises:
        ConfigError: the file is missing or not valid YAML (with the line), an
            override is not ``key=value``, a key is unknown (with close
            matches), a value has the wrong type or is out of range, a key
            that the other keys make meaningless is set, or
            ``federation.executor=ray`` without Ray installed.
    """
    raw = OmegaConf.create() if path is None else _read_yaml(Path(path))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"Override {bad[0]!r} is not of the form key=value (e.g. federation.rounds=5).")
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"The config in {path} must be a mapping of sections (data, model, method, ...).")
    file_method = OmegaConf.select(raw, "method.name", default="fedavg")
    for override in overrides:
        key, value = (part.strip() for part in override.split("=", 1))
        try:
            if key in SWITCHED:  # NAME's defaults, not the file's keys of another method or model
                raw[key] = {"name": value}
                file_method = None if key == "method" else file_method
            else:
                raw = OmegaConf.merge(raw, OmegaConf.from_dotlist([override]))
        except OmegaConfBaseException as e:
            raise ConfigError(f"Could not apply the override {override!r}: {e}") from None
    return validate(raw, file_method)


def validate(raw: DictConfig, file_method: Optional[str] = None) -> DictConfig:
    """Merge ``raw`` onto the schema defaults and check every key and value; the method section last (its schema
    is the method's module, which imports torch; most of its errors are found before, from the module's
    source). ``file_method``: the method the config file named, for the error when ``method.name`` was set to
    another one whose keys differ.

    Raises:
        ConfigError: see :func:`load_config`.
    """
    raw = raw.copy()
    method_raw = _merge(OmegaConf.create({"name": "fedavg"}), raw.pop("method", None) or {})
    _refuse_moved(raw)
    cfg = _merge(OmegaConf.structured(ExperimentConfig), raw, elsewhere=lambda: _method_keys(method_raw))
    try:
        OmegaConf.resolve(cfg)
        OmegaConf.resolve(method_raw)
    except OmegaConfBaseException as e:
        raise ConfigError(f"Could not resolve an interpolation in the config: {e}") from None
    experiment: ExperimentConfig = OmegaConf.to_object(cfg)
    _check_ranges(experiment, "")
    _check_parts(experiment)
    cfg.method = _method_section(method_raw, file_method)
    for key in ("root", "cache_dir"):
        if cfg.data[key] is not None:
            cfg.data[key] = str(Path(cfg.data[key]).expanduser().resolve())
    if cfg.data.path is not None and Path(cfg.data.path).expanduser().exists():  # a local copy, not a hub id
        cfg.data.path = str(Path(cfg.data.path).expanduser().resolve())
    if cfg.federation.system.trace is not None:
        cfg.federation.system.trace = str(Path(cfg.federation.system.trace).expanduser().resolve())
    if cfg.name is None:
        cfg.name = f"{cfg.method.name}-{cfg.data.source}"
    return cfg


def _check_parts(config: ExperimentConfig) -> None:
    """The chosen source, partition, model and executor: a key another one reads is refused unless it holds its
    default, and each checks its own keys (:meth:`plfl.fields.Component.check`).

    Raises:
        ConfigError: naming the key, who reads it, and the fix.
    """
    data = config.data
    source = _chosen("data", data, "source", data_sources())
    partition_keys = {f.name for cls in partitions().values() for f in dataclasses.fields(cls)}
    if not source.partitioned():
        for f in dataclasses.fields(data):
            if f.name in partition_keys and getattr(data, f.name) != default_of(f):
                raise ConfigError(source.unpartitioned(f.name, as_yaml(getattr(data, f.name))))
    else:
        _chosen("data", data, "partition", partitions())
    _chosen("model", config.model, "name", models())
    _check_robustness(config)
    _check_privacy(config)
    federation = config.federation
    if federation.local_epochs is not None and federation.local_steps is not None:
        raise ConfigError(
            f"federation.local_epochs={federation.local_epochs} and federation.local_steps={federation.local_steps} "
            "are both set: a round trains either epochs or steps. Remove one of them (as an override: "
            "federation.local_epochs=null)."
        )
    if federation.executor not in executors():
        close = difflib.get_close_matches(federation.executor, list(executors()), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"Config key 'federation.executor' must be one of {', '.join(executors())}; got "
            f"{federation.executor!r}.{hint}"
        )
    for name, options in executors().items():
        section = getattr(config, name, None)
        if section is None or name == federation.executor:
            continue
        for f in dataclasses.fields(options):
            if getattr(section, f.name) != default_of(f):
                raise ConfigError(
                    f"{name}.{f.name}={as_yaml(getattr(section, f.name))} is read only by federation.executor={name}, "
                    f"not by "
                    f"federation.executor={federation.executor}. Remove {name}.{f.name} or set "
                    f"federation.executor={name}."
                )
    config.executor_options.check()
    if (
        federation.executor == "ray"
        and config.trainer.accelerator in ("gpu", "cuda")
        and not config.ray.num_gpus_per_actor
    ):
        raise ConfigError(
            f"trainer.accelerator={config.trainer.accelerator} with federation.executor=ray needs "
            "GPUs for the actors: set ray.num_gpus_per_actor (e.g. 0.5 for two actors per GPU)."
        )


def _check_robustness(config: ExperimentConfig) -> None:
    """``attack.*`` and ``aggregation.*``: an attack needs malicious clients and malicious clients an attack; a
    key that the chosen rule or attack does not read holds its default.

    Raises:
        ConfigError: naming the key and the fix.
    """
    attack = config.attack
    if (attack.kind == "none") != (attack.fraction == 0):
        raise ConfigError(
            f"attack.kind={attack.kind} with attack.fraction={attack.fraction}: an attack needs malicious clients "
            "and malicious clients an attack. Set both (e.g. attack.kind=sign_flip attack.fraction=0.2) or neither."
        )
    readers = {
        "attack.scale": ("sign_flip", "scale"),
        "attack.noise_std": ("gaussian",),
        "attack.target": ("backdoor",),
        "attack.poison_fraction": ("backdoor",),
        "aggregation.trim": ("trimmed_mean",),
        "aggregation.byzantine": ("krum", "multi_krum"),
        "aggregation.selected": ("multi_krum",),
        "aggregation.max_norm": ("norm_bound",),
    }
    for key, users in readers.items():
        section_name, name = key.split(".")
        section = getattr(config, section_name)
        chosen = section.kind if section_name == "attack" else section.rule
        f = next(f for f in dataclasses.fields(section) if f.name == name)
        if chosen not in users and getattr(section, name) != default_of(f):
            choice = "attack.kind" if section_name == "attack" else "aggregation.rule"
            raise ConfigError(
                f"{key}={as_yaml(getattr(section, name))} is read only by {choice}={' or '.join(users)}, not by "
                f"{choice}={chosen}. Remove {key} (or set {choice}={users[0]})."
            )


def _check_privacy(config: ExperimentConfig) -> None:
    """``privacy.*``: a key that the chosen level (or fixed clipping) does not read holds its default, and client-level
    DP's mean is not replaced by a robust rule.

    Raises:
        ConfigError: naming the key and the fix.
    """
    privacy = config.privacy
    if privacy.level == "client" and config.aggregation.rule != "mean":
        raise ConfigError(
            f"privacy.level=client with aggregation.rule={config.aggregation.rule}: client-level DP clips and noises "
            "the mean of the updates, and its guarantee is for that mean, not for a robust rule. Set "
            "aggregation.rule=mean (clipping already bounds each client's influence) or privacy.level=none."
        )
    adaptive_keys = ("target_quantile", "clip_lr", "quantile_noise")
    # The keys each level reads (level itself aside): a key the chosen level does not read holds its default.
    reads = {
        "none": (),
        "client": ("noise_multiplier", "clip", "adaptive", *adaptive_keys, "delta", "accountant"),
        "sample": ("noise_multiplier", "max_grad_norm", "target_epsilon", "delta", "accountant"),
    }
    for f in dataclasses.fields(privacy):
        value = getattr(privacy, f.name)
        if f.name == "level" or value == default_of(f):
            continue
        if f.name not in reads[privacy.level]:
            users = [level for level, keys in reads.items() if f.name in keys]
            raise ConfigError(
                f"privacy.{f.name}={as_yaml(value)} is read only by privacy.level={' or '.join(users)}, not by "
                f"privacy.level={privacy.level}. Remove privacy.{f.name} (or set privacy.level={users[0]})."
            )
        if f.name in adaptive_keys and not privacy.adaptive:
            raise ConfigError(
                f"privacy.{f.name}={as_yaml(value)} is read only by privacy.adaptive=true, not by fixed clipping. "
                f"Remove privacy.{f.name} (or set privacy.adaptive=true)."
            )
        if f.name == "noise_multiplier" and privacy.target_epsilon is not None:
            raise ConfigError(
                f"privacy.noise_multiplier={as_yaml(value)} with privacy.target_epsilon={privacy.target_epsilon}: "
                "σ is computed from the target ε. Remove one of them."
            )


def _chosen(section: str, values: Any, key: str, components: dict[str, type[Component]]) -> Component:
    """The component of ``components`` that ``values.<key>`` chooses, with its keys from ``values`` (the section)
    and checked; a key of the section that another of them reads must hold its default.

    Raises:
        ConfigError: such a key holds another value (naming who reads it), or the component's own check fails.
    """
    chosen = getattr(values, key)
    own = key_names(components[chosen])
    for f in dataclasses.fields(values):
        value, who = getattr(values, f.name), readers(components, f.name)
        if f.name in own or not who or value == default_of(f):
            continue
        note = components[chosen].notes.get(f.name)
        alternative = f", or set {section}.{key}={who[0]}" if len(who) == 1 else ""
        if section in SWITCHED:
            alternative += f"; {section}={chosen} takes {chosen}'s defaults in place of the section"
        raise ConfigError(
            f"{section}.{f.name}={as_yaml(value)} is read only by {section}.{key}={' or '.join(who)}, not by "
            f"{section}.{key}={chosen}{'; ' + note if note else ''}. Remove {section}.{f.name} (or set its default, "
            f"{section}.{f.name}={as_yaml(default_of(f))}){alternative}."
        )
    component = components[chosen].of(values)
    component.check()
    return component


def _method_section(method_raw: DictConfig, file_method: Optional[str]) -> DictConfig:
    """The method section merged onto the named method's schema, its ranges checked.

    Raises:
        ConfigError: an unknown method, or a key or value the method refuses; for a key of the file's method
            after ``method.name`` named another, the message says so and names ``method=NAME``.
    """
    name = str(method_raw.name)

    def merged(schema: type) -> DictConfig:
        try:
            return _merge(OmegaConf.structured(schema), method_raw, prefix="method.")
        except ConfigError as error:
            if file_method is None or file_method == name:
                raise
            raise ConfigError(
                f"{error} The config names method.name={name}, but its method section holds the keys of "
                f"{file_method}: write method={name} instead of method.name={name} to take {name}'s defaults in "
                "place of that section."
            ) from None

    rebuilt = source_config_class(name)
    if rebuilt is not None:  # refuses most errors before the method's module (and torch) is imported
        _check_ranges(OmegaConf.to_object(merged(rebuilt)), "method")
    section = merged(method_class(name).config_class)
    _check_ranges(OmegaConf.to_object(section), "method")
    return section


def _method_keys(method_raw: DictConfig) -> tuple[str, ...]:
    """The named method's ``method.*`` keys: for a misplaced key's suggestion only."""
    name = str(method_raw.name)
    try:
        schema = source_config_class(name) or method_class(name).config_class
    except ConfigError:
        return ()
    return tuple(f"method.{f.name}" for f in dataclasses.fields(schema))


def _refuse_moved(raw: DictConfig) -> None:
    """Drop the keys of :data:`MOVED` that hold their defaults (saved configs have them).

    Raises:
        ConfigError: one holds another value (the message names its new key).
    """
    defaults = OmegaConf.structured(ExperimentConfig)
    for old, new in MOVED.items():
        section, key = old.split(".")
        if section in raw and key in raw[section]:
            value = raw[section].pop(key)
            if value != OmegaConf.select(defaults, new):
                raise ConfigError(f"{old} is now {new}: write {new}={as_yaml(value)}.")


def resume_config(run_dir: Path, overrides: list[str] = ()) -> DictConfig:
    """The config of the run in ``run_dir`` (its config.yaml) with ``overrides`` applied.

    Raises:
        PlflError: ``run_dir`` is not a run directory.
        ConfigError: an invalid override, or one that changes what the saved state
            depends on (``data.*``, ``model.*``, ``method.name``, ``privacy.*``; ``federation.rounds`` when
            ``privacy.target_epsilon`` set σ for them).
    """
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise PlflError(
            f"{run_dir} is not a plfl run directory (it has no config.yaml); pass the "
            "runs/<name>/<time>/ directory that plfl fit printed."
        )
    saved = load_config(path)
    cfg = load_config(path, overrides)
    for key in ("data", "model", "method.name", "privacy"):
        if OmegaConf.select(cfg, key) != OmegaConf.select(saved, key):
            raise ConfigError(
                f"--resume cannot change {key}: the checkpoint holds state for the saved "
                f"{key}. Start a new run with plfl fit --config {path} {' '.join(overrides)}."
            )
    rounds = cfg.federation.rounds
    if saved.privacy.target_epsilon is not None and rounds != saved.federation.rounds:
        raise ConfigError(
            f"--resume cannot change federation.rounds (to {rounds}) with privacy.target_epsilon="
            f"{saved.privacy.target_epsilon}: σ was computed for federation.rounds={saved.federation.rounds}. Start a "
            f"new run with plfl fit --config {path} {' '.join(overrides)}."
        )
    return cfg


def _read_yaml(path: Path) -> DictConfig:
    return OmegaConf.create(
        read_yaml(path, f"Config file {path} does not exist. Pass an existing YAML file to --config.") or {}
    )


def read_yaml(path: Path, missing: str) -> Any:
    """The YAML document in ``path`` (a config, a sweep, a suite).

    Raises:
        ConfigError: ``path`` is not a file (``missing`` is the message), or not valid YAML (the message gives the
            line and column of the problem).
    """
    if not path.is_file():
        raise ConfigError(missing)
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{path} is not valid YAML{where}: {problem}. Fix the file and run again.") from None


def _merge(
    schema: DictConfig, values: Any, prefix: str = "", elsewhere: Callable[[], tuple[str, ...]] = tuple
) -> DictConfig:
    try:
        return OmegaConf.merge(schema, values)
    except ConfigKeyError as e:
        key = e.full_key or str(e.key)
        raise ConfigError(_unknown_key_message(schema, key, prefix, elsewhere)) from None
    except ValidationError as e:
        key = prefix + (e.full_key or "")
        raise ConfigError(
            f"Config key '{key}' has a value of the wrong type: {e.msg.splitlines()[0]}. "
            f"Expected {_expected_type(schema, key.removeprefix(prefix))}."
        ) from None


def dotted_items(values: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a config (a DictConfig, or nested dicts): ``federation.rounds``;
    lists are leaves."""
    if isinstance(values, DictConfig):
        values = OmegaConf.to_container(values)
    for name, value in values.items():
        if isinstance(value, dict):
            yield from dotted_items(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def _dotted_keys(values: Any, prefix: str = "") -> tuple[str, ...]:
    return tuple(key for key, _ in dotted_items(values, prefix))


def _unknown_key_message(
    schema: DictConfig, key: str, prefix: str, elsewhere: Callable[[], tuple[str, ...]] = tuple
) -> str:
    """The error for an unknown ``key``: close matches in its section, else anywhere in ``schema`` or among the
    keys ``elsewhere()`` gives (a section checked later, e.g. the method's: asked only then)."""
    *parents, leaf = key.split(".")
    node = schema
    for part in parents:
        node = node[part] if isinstance(node, DictConfig) and part in node else None
        if node is None:
            break
    valid = sorted(node.keys()) if isinstance(node, DictConfig) else []
    section = prefix + ".".join(parents)
    close = [f"'{prefix}{'.'.join(parents + [name])}'" for name in difflib.get_close_matches(leaf, valid, n=3)]
    if not close:  # maybe the key belongs in another section: roundz → federation.rounds
        candidates = [f"{prefix}{k}" for k in _dotted_keys(schema)]
        leaves = {c.rsplit(".", 1)[-1]: c for c in reversed(candidates)}
        if not difflib.get_close_matches(leaf, list(leaves), n=1):
            candidates += list(elsewhere())
        leaves = {c.rsplit(".", 1)[-1]: c for c in reversed(candidates)}
        close = [f"'{leaves[name]}'" for name in difflib.get_close_matches(leaf, list(leaves), n=3)]
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    where = f"section '{section.rstrip('.')}'" if section else "the top level"
    return f"Unknown config key '{prefix}{key}'.{hint} Valid keys in {where}: {', '.join(valid)}."


def _expected_type(schema: DictConfig, key: str) -> str:
    *parents, leaf = key.split(".")
    obj: Any = OmegaConf.to_object(schema) if parents or leaf else None
    for part in parents:
        obj = getattr(obj, part, None)
    hints = {f.name: f.type for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
    kind = hints.get(leaf, "a value of the declared type")
    return kind if isinstance(kind, str) else inspect.formatannotation(kind)  # a rebuilt class's types are types


def _check_ranges(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        check = f.metadata.get("check")
        if check is not None and not check(value):
            raise ConfigError(f"Config key '{key}' must be {allowed(f)}; got {value!r}.")
        if dataclasses.is_dataclass(value):
            _check_ranges(value, key)
