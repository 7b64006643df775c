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
from plfl.fields import allowed, checked, one_of
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

    source: str = one_of("digits", lambda: data_sources())
    # Directory of the files; relative paths resolve against the current directory.
    root: Optional[str] = None
    # Number of clients (default 20); ``pfllib`` without ``repartition`` takes it from config.json (a set value
    # must agree).
    num_clients: Optional[int] = checked(None, lambda v: v is None or v >= 1, "an integer >= 1")
    partition: str = one_of("dirichlet", PARTITIONS)
    # ``pfllib``: pool all clients' train and test files and partition them like a pooled source.
    repartition: bool = False
    # Dirichlet concentration β: smaller is more skewed.
    beta: float = checked(0.1, lambda v: v > 0, "a number > 0")
    # Pathological and classes partitions: distinct classes per client.
    classes_per_client: int = checked(2, lambda v: v >= 1, "an integer >= 1")
    # Dominant partition: classes per client that hold ``dominant_fraction`` of its samples.
    dominant_classes: int = checked(2, lambda v: v >= 1, "an integer >= 1")
    # 0.8: FedAMP's practical non-IID setting (80 % of a client's data from its dominant classes).
    dominant_fraction: float = checked(0.8, lambda v: 0 < v < 1, "a number in (0, 1)")
    # Fraction of each client's samples held out as its test split.
    test_fraction: float = checked(0.25, lambda v: 0 < v < 1, "a number in (0, 1)")
    # Dirichlet: every client gets at least this many samples (train + test).
    min_samples: int = checked(10, lambda v: v >= 2, "an integer >= 2")
    # Dirichlet: how many draws to try before giving up on ``min_samples``.
    max_retries: int = checked(100, lambda v: v >= 1, "an integer >= 1")
    # torchvision sources only; there is no network here, so it stays off by default.
    download: bool = False
    # ``imagefolder``: where decoded images are cached (null: $XDG_CACHE_HOME/plfl, else ~/.cache/plfl).
    cache_dir: Optional[str] = None
    # Training batches get a random crop (4-pixel zero padding) and a horizontal flip per sample; images only.
    augment: bool = False
    # agnews: file names under ``root`` (the official names; a prefix of train.csv works too).
    train_file: str = "train.csv"
    test_file: str = "test.csv"
    # Text: most token ids, [PAD] and [UNK] included (32000: PFLlib's AG News cap); trained on training texts only.
    vocab_size: int = checked(32000, lambda v: v >= 3, "an integer >= 3")
    # Text: token ids per sample; longer texts are cut, shorter ones padded with id 0 (200: FedALA, PFLlib).
    max_length: int = checked(200, lambda v: v >= 1, "an integer >= 1")
    # shakespeare: a speaking role needs this many characters (= samples) to be a client; >= 400 leaves every
    # client a test window after LEAF's 79-window gap. 10,000 gives 36 clients on tiny Shakespeare.
    min_chars: int = checked(10_000, lambda v: v >= 400, "an integer >= 400")
    # ``leaf``: the shape each flat x row is reshaped to, (C, H, W); required for image data ([1, 28, 28]: FEMNIST).
    image_shape: Optional[list[int]] = checked(
        None, lambda v: v is None or (len(v) > 0 and min(v) >= 1), "null or a non-empty list of integers >= 1"
    )
    # ``leaf``: the number of classes; null: the largest label of both splits + 1 (state it when classes may be absent).
    num_classes: Optional[int] = checked(None, lambda v: v is None or v >= 2, "null or an integer >= 2")

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

    name: str = one_of("mlp", lambda: model_names())
    # MLP only: widths of the hidden layers.
    hidden_sizes: list[int] = field(default_factory=lambda: [200])
    # CNN, LeNet-5 and MLP: a BatchNorm layer before every ReLU (FedBN's models); resnet18 always has them.
    batch_norm: bool = False
    # fasttext, transformer, lstm: width of the token embeddings (null: the model's own, 32 for fasttext and
    # transformer as FedALA's fastText, 8 for lstm as LEAF's).
    embedding_dim: Optional[int] = checked(None, lambda v: v is None or v >= 1, "an integer >= 1")
    # transformer only: encoder layers, and attention heads per layer (embedding_dim must be a multiple).
    num_layers: int = checked(2, lambda v: v >= 1, "an integer >= 1")
    num_heads: int = checked(2, lambda v: v >= 1, "an integer >= 1")
    # lstm only: LSTM hidden units (LEAF's 256).
    hidden_dim: int = checked(256, lambda v: v >= 1, "an integer >= 1")

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

    rounds: int = checked(20, lambda v: v >= 0, "an integer >= 0")
    # Fraction of clients sampled for training in each round.
    join_ratio: float = checked(1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    local_epochs: int = checked(1, lambda v: v >= 1, "an integer >= 1")
    batch_size: int = checked(10, lambda v: v >= 1, "an integer >= 1")
    lr: float = checked(0.005, lambda v: v > 0, "a number > 0")
    # SGD momentum of local training (FedFTHA uses 0.5); its buffer does not outlive a client's round.
    momentum: float = checked(0.0, lambda v: 0 <= v < 1, "a number in [0, 1)")
    seed: int = 0
    # Evaluate every this many rounds (the last round is always evaluated).
    eval_every: int = checked(1, lambda v: v >= 1, "an integer >= 1")
    # A client whose training raises or returns NaN/Inf is left out of its round's aggregation;
    # the round fails when more than this many sampled clients fail (null: only when all of them do).
    max_failed_clients: Optional[int] = checked(None, lambda v: v is None or v >= 0, "null or an integer >= 0")
    # Where the clients' training and evaluation run: one after another on one Lightning Trainer (sequential),
    # a round's clients stacked and trained in lock-step with torch.func (vectorized), or spread over a pool of
    # Ray actors (ray, options in the ray section; plfl.executors).
    executor: str = one_of("sequential", EXECUTORS)
    # vectorized: the most clients stacked at once (null: all of a call's); memory grows linearly with it.
    cohort_size: Optional[int] = checked(None, lambda v: v is None or v >= 1, "null or an integer >= 1")
    # vectorized on a CUDA device: each lock-step step (training, ALA, evaluation) is captured once per shape as a
    # CUDA graph and replayed (false: launched op by op, e.g. to compare).
    cuda_graphs: bool = True
    # Keep the clients' stored tensors (personalized models, statistics) in files under <run dir>/client-state
    # instead of RAM, reading a client's when it is used: for many clients (plfl.state).
    state_offload: bool = False

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

    # local: start Ray on this machine with the actors' CPUs; auto: join the cluster this machine belongs to
    # (ray start); host:port: a cluster's head; ray://host:10001: a remote cluster through Ray Client.
    address: str = "local"
    num_actors: int = checked(2, lambda v: v >= 1, "an integer >= 1")
    # Ray's resources per actor; fractions let several actors share a CPU or a GPU.
    num_cpus_per_actor: float = checked(1.0, lambda v: v > 0, "a number > 0")
    num_gpus_per_actor: float = checked(0.0, lambda v: v >= 0, "a number >= 0")


@dataclass
class LoggerConfig:
    """Where metrics go besides the console (``logger.*``).

    ``csv`` writes metrics.csv and clients.csv in the run directory; ``wandb``
    does that and logs to Weights & Biases; ``none`` writes only config.yaml
    and summary.json.
    """

    name: str = one_of("csv", LOGGERS)
    project: str = "plfl"
    entity: Optional[str] = None


@dataclass
class TrainerConfig:
    """Options passed to the one Lightning ``Trainer`` (``trainer.*``)."""

    accelerator: str = "cpu"
    devices: int = 1
    precision: str = "32-true"


@dataclass
class ExperimentConfig:
    """The whole experiment; ``method`` is checked by the named method's own schema."""

    # Run name: runs/<name>/<time>/; defaults to "<method>-<data source>".
    name: Optional[str] = None
    output_dir: str = "runs"
    progress_bar: bool = True
    # Save the federation's state every this many rounds and after the last (0: never); plfl fit --resume.
    checkpoint_every: int = checked(1, lambda v: v >= 0, "an integer >= 0")
    # How many of the newest checkpoints to keep (more than one survives a damaged latest file).
    keep_checkpoints: int = checked(2, lambda v: v >= 1, "an integer >= 1")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: Any = field(default_factory=lambda: {"name": "fedavg"})
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
