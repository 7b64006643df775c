"""Typed experiment configuration: schemas, loading, overrides and validation.

A config is one YAML file plus ``key=value`` dot-list overrides (OmegaConf),
checked against the dataclasses below before anything trains. Method sections
are checked against the schema of the named method (``plfl.methods``).
Nothing here imports torch: a config is checked in well under a second.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from plfl.cluster import import_ray
from plfl.errors import ConfigError, PlflError
from plfl.fields import allowed, checked, documented, one_of
from plfl.methods import method_class

PARTITIONS = ("dirichlet", "pathological", "classes", "dominant", "iid")
LOGGERS = ("csv", "wandb", "none")
EXECUTORS = ("sequential", "vectorized", "ray")
DEFAULT_NUM_CLIENTS = 20  # data.num_clients of a partitioned source when unset


def data_sources() -> tuple[str, ...]:
    """The ``data.source`` names: the data registry's (:data:`plfl.data.sources.SOURCES`)."""
    from plfl.data.sources import SOURCES

    return SOURCES


def model_names() -> tuple[str, ...]:
    """The ``model.name`` names: the model registry's (:data:`plfl.models.MODELS`)."""
    from plfl.models import MODELS

    return tuple(MODELS)


@dataclass
class DataConfig:
    """Which data set, and how it is split over clients (``data.*``).

    Raises:
        ConfigError: a key that the other keys make meaningless has a non-default
            value: a source's own key (``cache_dir``, ``vocab_size``, ``image_shape`` ...) with another
            source, ``repartition`` for a source other than ``pfllib``, a partition
            key for ``pfllib`` without ``repartition`` or for ``leaf``, or a key the chosen
            ``partition`` does not read (``beta`` with ``partition=classes``).
    """

    source: str = one_of("digits", lambda: data_sources(), "the data set and its reader (the data sources' guide)")
    root: Optional[str] = documented(
        None, "directory (or file) of the data; a relative path resolves against the current directory"
    )
    num_clients: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "an integer >= 1",
        "clients of a partitioned source (null: 20); pfllib without repartition and leaf take theirs from the "
        "files, and a value set must agree",
    )
    partition: str = one_of(
        "dirichlet",
        PARTITIONS,
        "how a pooled data set is split over clients: Dirichlet label skew, pathological (c classes each, "
        "disjoint samples), classes (pFedLA's non-IID_1), dominant (pFedLA's non-IID_2), iid",
    )
    repartition: bool = documented(
        False, "pfllib: pool all clients' train and test files and partition them like a pooled source"
    )
    beta: float = checked(0.1, lambda v: v > 0, "a number > 0", "dirichlet: concentration β; smaller is more skewed")
    classes_per_client: int = checked(
        2, lambda v: v >= 1, "an integer >= 1", "pathological and classes: distinct classes per client (c)"
    )
    dominant_classes: int = checked(
        2, lambda v: v >= 1, "an integer >= 1", "dominant: classes per client that hold dominant_fraction of it (d)"
    )
    dominant_fraction: float = checked(
        0.8,
        lambda v: 0 < v < 1,
        "a number in (0, 1)",
        "dominant: share of a client's samples from its dominant classes (f; 0.8 is FedAMP's practical non-IID)",
    )
    test_fraction: float = checked(
        0.25, lambda v: 0 < v < 1, "a number in (0, 1)", "share of each client's samples held out as its test split"
    )
    min_samples: int = checked(
        10, lambda v: v >= 2, "an integer >= 2", "dirichlet: every client gets at least this many samples"
    )
    max_retries: int = checked(
        100, lambda v: v >= 1, "an integer >= 1", "dirichlet: draws tried before giving up on min_samples"
    )
    download: bool = documented(False, "torchvision sources: let torchvision download missing files (needs internet)")
    cache_dir: Optional[str] = documented(
        None, "imagefolder: where decoded images are cached (null: $XDG_CACHE_HOME/plfl, else ~/.cache/plfl)"
    )
    augment: bool = documented(
        False,
        "images: each training sample is zero-padded by 4 pixels, randomly cropped back and flipped left-right "
        "with probability ½, drawn from the run's seeds; evaluation never augments",
    )
    train_file: str = documented("train.csv", "agnews: the training CSV under root (a prefix of train.csv works)")
    test_file: str = documented("test.csv", "agnews: the test CSV under root")
    vocab_size: int = checked(
        32000,
        lambda v: v >= 3,
        "an integer >= 3",
        "text (agnews, leaf): most token ids, [PAD] = 0 and [UNK] = 1 included; learnt on training texts only",
    )
    max_length: int = checked(
        200,
        lambda v: v >= 1,
        "an integer >= 1",
        "text (agnews, leaf): token ids per sample; longer texts are cut, shorter ones padded with 0",
    )
    min_chars: int = checked(
        10_000,
        lambda v: v >= 400,
        "an integer >= 400",
        "shakespeare: characters (= samples) a speaking role needs to be a client; >= 400 leaves every client a "
        "test window after LEAF's 79-window gap",
    )
    image_shape: Optional[list[int]] = checked(
        None,
        lambda v: v is None or (len(v) > 0 and min(v) >= 1),
        "null or a non-empty list of integers >= 1",
        "leaf: the shape (C, H, W) each flat x row is reshaped to; required for image data ([1, 28, 28]: FEMNIST)",
    )
    num_classes: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 2,
        "null or an integer >= 2",
        "leaf: the class count (null: the largest label of both splits + 1; set it when classes may be absent)",
    )

    @property
    def clients(self) -> int:
        """How many clients a partitioned source is split over: ``num_clients``, by default 20."""
        return DEFAULT_NUM_CLIENTS if self.num_clients is None else self.num_clients

    def __post_init__(self) -> None:
        # Keys that only partitioning reads, with the partitions that read them (empty: all of them).
        partition_keys = {
            "partition": (),
            "test_fraction": (),
            "beta": ("dirichlet",),
            "min_samples": ("dirichlet",),
            "max_retries": ("dirichlet",),
            "classes_per_client": ("pathological", "classes"),
            "dominant_classes": ("dominant",),
            "dominant_fraction": ("dominant",),
        }
        # Keys that only some sources read.
        source_keys = {
            "cache_dir": ("imagefolder",),
            "train_file": ("agnews",),
            "test_file": ("agnews",),
            "vocab_size": ("agnews", "leaf"),
            "max_length": ("agnews", "leaf"),
            "min_chars": ("shakespeare",),
            "image_shape": ("leaf",),
            "num_classes": ("leaf",),
        }
        for f in dataclasses.fields(self):
            readers = source_keys.get(f.name)
            if readers and self.source not in readers and getattr(self, f.name) != f.default:
                raise ConfigError(
                    f"data.{f.name}={getattr(self, f.name)} is read only by data.source="
                    f"{' or '.join(readers)}, not by data.source={self.source}. Remove data.{f.name}."
                )
        if self.repartition and self.source != "pfllib":
            raise ConfigError(
                f"data.repartition=true applies only to data.source=pfllib; data.source={self.source} "
                "is always partitioned by data.partition. Remove data.repartition."
            )
        changed = [
            f.name for f in dataclasses.fields(self) if f.name in partition_keys and getattr(self, f.name) != f.default
        ]
        if self.source == "leaf" and changed:
            key = changed[0]
            raise ConfigError(
                f"data.{key}={getattr(self, key)} has no effect: data.source=leaf keeps the users (one "
                f"client each) and train/test splits of its files. Remove data.{key}."
            )
        if self.source == "pfllib" and not self.repartition and changed:
            key = changed[0]
            raise ConfigError(
                f"data.{key}={getattr(self, key)} has no effect: data.source=pfllib keeps the clients "
                "and train/test splits of its files. Set data.repartition=true to pool and re-partition "
                f"them, or remove data.{key}."
            )
        for key in changed:
            readers = partition_keys[key]
            if readers and self.partition not in readers:
                raise ConfigError(
                    f"data.{key}={getattr(self, key)} is read only by data.partition="
                    f"{' or '.join(readers)}, not by data.partition={self.partition}. Remove "
                    f"data.{key} or set data.partition={readers[0]}."
                )


@dataclass
class ModelConfig:
    """The network (``model.*``); input shape and class count come from the data."""

    name: str = one_of(
        "mlp",
        lambda: model_names(),
        "the network, split into a body (representation) and a head (last classifier layer): mlp, cnn (FedAvg's "
        "4-layer CNN), lenet5, resnet18 (torchvision); for text fasttext, transformer, lstm (LEAF's)",
    )
    hidden_sizes: list[int] = documented(doc="mlp: widths of the hidden layers", default_factory=lambda: [200])
    batch_norm: bool = documented(
        False, "cnn, lenet5, mlp: a BatchNorm layer before every ReLU (FedBN's models); resnet18 always has them"
    )
    embedding_dim: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "an integer >= 1",
        "fasttext, transformer, lstm: width of the token embeddings (null: 32 for fasttext and transformer, "
        "as FedALA's fastText; 8 for lstm, as LEAF's)",
    )
    num_layers: int = checked(2, lambda v: v >= 1, "an integer >= 1", "transformer: encoder layers")
    num_heads: int = checked(
        2, lambda v: v >= 1, "an integer >= 1", "transformer: attention heads per layer (divides embedding_dim)"
    )
    hidden_dim: int = checked(256, lambda v: v >= 1, "an integer >= 1", "lstm: LSTM hidden units (LEAF's 256)")

    def __post_init__(self) -> None:
        # Keys that only some models read.
        model_keys = {
            "embedding_dim": ("fasttext", "transformer", "lstm"),
            "num_layers": ("transformer",),
            "num_heads": ("transformer",),
            "hidden_dim": ("lstm",),
            "batch_norm": ("cnn", "lenet5", "mlp"),
        }
        for f in dataclasses.fields(self):
            readers = model_keys.get(f.name)
            if readers and self.name not in readers and getattr(self, f.name) != f.default:
                always = (
                    "; resnet18 always has BatchNorm layers"
                    if (f.name, self.name) == ("batch_norm", "resnet18")
                    else ""
                )
                raise ConfigError(
                    f"model.{f.name}={getattr(self, f.name)} is read only by model.name="
                    f"{' or '.join(readers)}, not by model.name={self.name}{always}. Remove model.{f.name}."
                )
        if self.name == "transformer" and self.embedding_dim and self.embedding_dim % self.num_heads:
            raise ConfigError(
                f"model.embedding_dim={self.embedding_dim} is not a multiple of model.num_heads="
                f"{self.num_heads}: each attention head takes an equal share of the embedding. "
                "Change one of them."
            )


@dataclass
class FederationConfig:
    """Rounds, client sampling and local training (``federation.*``)."""

    rounds: int = checked(20, lambda v: v >= 0, "an integer >= 0", "R: rounds of training; rounds 0..R are evaluated")
    join_ratio: float = checked(
        1.0, lambda v: 0 < v <= 1, "a number in (0, 1]", "fraction of the clients sampled for training each round"
    )
    local_epochs: int = checked(1, lambda v: v >= 1, "an integer >= 1", "local epochs per round")
    batch_size: int = checked(10, lambda v: v >= 1, "an integer >= 1", "mini-batch size of local training")
    lr: float = checked(0.005, lambda v: v > 0, "a number > 0", "SGD learning rate of local training")
    momentum: float = checked(
        0.0,
        lambda v: 0 <= v < 1,
        "a number in [0, 1)",
        "SGD momentum of local training (FedFTHA uses 0.5); its buffer does not outlive a client's round",
    )
    seed: int = documented(0, "seeds the partition, the initial model, client sampling and every batch order")
    eval_every: int = checked(
        1, lambda v: v >= 1, "an integer >= 1", "evaluate every this many rounds (and always the last)"
    )
    max_failed_clients: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 0,
        "null or an integer >= 0",
        "a client whose training raises or diverges is left out of its round; the round fails when more than "
        "this many fail (null: only when all do)",
    )
    executor: str = one_of(
        "sequential",
        EXECUTORS,
        "where client work runs: one client after another on one Lightning Trainer (sequential), a round's "
        "clients stacked and trained in lock-step with torch.func (vectorized), or a pool of Ray actors (ray)",
    )
    cohort_size: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "null or an integer >= 1",
        "vectorized: the most clients stacked at once (null: all of a call's); memory grows linearly with it",
    )
    cuda_graphs: bool = documented(
        True,
        "vectorized on CUDA: capture each lock-step step once per shape as a CUDA graph and replay it (false: "
        "launch its kernels one by one)",
    )
    state_offload: bool = documented(
        False,
        "keep the clients' stored tensors (personalized models, statistics) in files under <run dir>/client-state "
        "instead of RAM: for many clients",
    )

    def __post_init__(self) -> None:
        if not self.cuda_graphs and self.executor != "vectorized":
            raise ConfigError(
                f"federation.cuda_graphs=false is read only by federation.executor=vectorized, not by "
                f"federation.executor={self.executor}. Remove federation.cuda_graphs or set "
                "federation.executor=vectorized."
            )
        if self.cohort_size is not None and self.executor != "vectorized":
            raise ConfigError(
                f"federation.cohort_size={self.cohort_size} is read only by federation.executor="
                f"vectorized, not by federation.executor={self.executor}. Remove federation.cohort_size "
                "or set federation.executor=vectorized."
            )


@dataclass
class RayConfig:
    """The Ray actors of ``federation.executor=ray`` (``ray.*``); Ray is optional: ``pip install -e '.[ray]'``."""

    address: str = documented(
        "local",
        "local: start Ray in the plfl process with the actors' CPUs; auto: join the cluster of this host (ray "
        "start); HOST:PORT: a cluster's head; ray://HOST:10001: a remote cluster through Ray Client",
    )
    num_actors: int = checked(2, lambda v: v >= 1, "an integer >= 1", "Ray actors, each running one task at a time")
    num_cpus_per_actor: float = checked(
        1.0, lambda v: v > 0, "a number > 0", "Ray CPUs per actor (its torch threads); fractions share a CPU"
    )
    num_gpus_per_actor: float = checked(
        0.0, lambda v: v >= 0, "a number >= 0", "Ray GPUs per actor; fractions such as 0.25 share a GPU"
    )


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
class TrainerConfig:
    """Options passed to the one Lightning ``Trainer`` (``trainer.*``)."""

    accelerator: str = documented("cpu", "Lightning's accelerator: cpu, gpu (or cuda), ...")
    devices: int = documented(1, "Lightning's devices (plfl trains on one)")
    precision: str = documented(
        "32-true",
        "Lightning's precision (32-true, bf16-mixed, ...); 32-true is IEEE float32 on a GPU too (TF32 off), so "
        "GPU and CPU runs agree to float rounding",
    )


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
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        changed = [f.name for f in dataclasses.fields(self.ray) if getattr(self.ray, f.name) != f.default]
        if changed and self.federation.executor != "ray":
            key = changed[0]
            raise ConfigError(
                f"ray.{key}={getattr(self.ray, key)} is read only by federation.executor=ray, not by "
                f"federation.executor={self.federation.executor}. Remove ray.{key} or set "
                "federation.executor=ray."
            )
        if self.federation.executor == "ray":
            import_ray("federation.executor=ray")  # not installed: the install command, before anything runs
        if (
            self.federation.executor == "ray"
            and self.trainer.accelerator in ("gpu", "cuda")
            and not self.ray.num_gpus_per_actor
        ):
            raise ConfigError(
                f"trainer.accelerator={self.trainer.accelerator} with federation.executor=ray needs "
                "GPUs for the actors: set ray.num_gpus_per_actor (e.g. 0.5 for two actors per GPU)."
            )


def load_config(path: str | Path | None, overrides: list[str] = ()) -> DictConfig:
    """Read a YAML config, apply dot-list overrides and validate the result.

    Returns the resolved, validated config as a DictConfig (``${...}`` resolved,
    ``data.root`` made absolute, the method section filled with its defaults).

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
    try:
        raw = OmegaConf.merge(raw, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        raise ConfigError(f"Could not apply the overrides {list(overrides)}: {e}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"The config in {path} must be a mapping of sections (data, model, method, ...).")
    return validate(raw)


def validate(raw: DictConfig) -> DictConfig:
    """Merge ``raw`` onto the schema defaults and check every key and value.

    Raises:
        ConfigError: see :func:`load_config`.
    """
    method_raw = _merge(OmegaConf.create({"name": "fedavg"}), raw.pop("method", None) or {})
    method = OmegaConf.structured(method_class(str(method_raw.name)).config_class)
    # A misplaced method key (``s=40``) is suggested under ``method.``.
    cfg = _merge(OmegaConf.structured(ExperimentConfig), raw, elsewhere=_dotted_keys(method, "method."))
    cfg.method = _merge(method, method_raw, prefix="method.")
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(f"Could not resolve an interpolation in the config: {e}") from None
    _check_ranges(OmegaConf.to_object(cfg), "")
    for key in ("root", "cache_dir"):
        if cfg.data[key] is not None:
            cfg.data[key] = str(Path(cfg.data[key]).expanduser().resolve())
    if cfg.name is None:
        cfg.name = f"{cfg.method.name}-{cfg.data.source}"
    return cfg


def resume_config(run_dir: Path, overrides: list[str] = ()) -> DictConfig:
    """The config of the run in ``run_dir`` (its config.yaml) with ``overrides`` applied.

    Raises:
        PlflError: ``run_dir`` is not a run directory.
        ConfigError: an invalid override, or one that changes what the saved state
            depends on (``data.*``, ``model.*``, ``method.name``).
    """
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise PlflError(
            f"{run_dir} is not a plfl run directory (it has no config.yaml); pass the "
            "runs/<name>/<time>/ directory that plfl fit printed."
        )
    saved = load_config(path)
    cfg = load_config(path, overrides)
    for key in ("data", "model", "method.name"):
        if OmegaConf.select(cfg, key) != OmegaConf.select(saved, key):
            raise ConfigError(
                f"--resume cannot change {key}: the checkpoint holds state for the saved "
                f"{key}. Start a new run with plfl fit --config {path} {' '.join(overrides)}."
            )
    return cfg


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"Config file {path} does not exist. Pass an existing YAML file to --config.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{path} is not valid YAML{where}: {problem}. Fix the file and run again.") from None
    return OmegaConf.create(data or {})


def _merge(schema: DictConfig, values: Any, prefix: str = "", elsewhere: tuple[str, ...] = ()) -> DictConfig:
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


def _unknown_key_message(schema: DictConfig, key: str, prefix: str, elsewhere: tuple[str, ...]) -> str:
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
        candidates = [f"{prefix}{k}" for k in _dotted_keys(schema)] + list(elsewhere)
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
    return str(hints.get(leaf, "a value of the declared type"))


def _check_ranges(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}.{f.name}" if prefix else f.name
        check = f.metadata.get("check")
        if check is not None and not check(value):
            raise ConfigError(f"Config key '{key}' must be {allowed(f)}; got {value!r}.")
        if dataclasses.is_dataclass(value):
            _check_ranges(value, key)
