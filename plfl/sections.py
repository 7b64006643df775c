"""The config sections that many parts of a run read: ``federation.*`` (the loop, the methods, the executors) and
``trainer.*`` (the clients' Lightning Trainer and the executors on its device).

Plain dataclasses of range-checked keys (:mod:`plfl.fields`), importing nothing of plfl's parts: every part may
import them, and :mod:`plfl.config` composes them with the sections its parts declare themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from plfl.fields import checked, documented, one_of


@dataclass
class SystemConfig:
    """Simulated client systems (``federation.system.*``): compute speed, network, dropout and a round deadline.

    Each participating client's profile (seconds per training sample, latency, bandwidth) is drawn once from the
    run's seed, log-normal about the given medians, or read from ``trace``; see :mod:`plfl.system`.
    """

    sample_seconds: Optional[float] = checked(
        None,
        lambda v: v is None or v > 0,
        "null or a number > 0",
        "median simulated seconds a client takes per training sample it processes (null: no simulated time; a "
        "deadline needs it or a trace)",
    )
    compute_spread: float = checked(
        0.0, lambda v: v >= 0, "a number >= 0", "log-std σ of the clients' seconds per sample (0: all alike)"
    )
    latency: float = checked(0.0, lambda v: v >= 0, "a number >= 0", "median seconds each message waits in the network")
    bandwidth: Optional[float] = checked(
        None,
        lambda v: v is None or v > 0,
        "null or a number > 0",
        "median bytes per second of a client's link (null: no limit)",
    )
    network_spread: float = checked(
        0.0, lambda v: v >= 0, "a number >= 0", "log-std σ of the clients' latency and bandwidth (0: all alike)"
    )
    trace: Optional[str] = documented(
        None,
        "a CSV of client profiles in place of the drawn ones: columns client (0..N-1, the participating clients), "
        "sample_seconds, latency, bandwidth (empty: no limit)",
    )
    dropout: float = checked(
        0.0, lambda v: 0 <= v < 1, "a number in [0, 1)", "probability that a sampled client drops out of its round"
    )
    deadline: Optional[float] = checked(
        None,
        lambda v: v is None or v > 0,
        "null or a number > 0",
        "simulated seconds from the round's broadcast by which a client's upload must arrive (null: none)",
    )
    late: str = one_of(
        "drop",
        ("drop", "partial"),
        "a client that would miss the deadline: drop (its round's work is discarded) or partial (its training is cut "
        "to the samples that fit, FedProx's partial work)",
    )

    @property
    def simulated(self) -> bool:
        """Whether clients have simulated times (``sample_seconds`` or ``trace``)."""
        return self.sample_seconds is not None or self.trace is not None


@dataclass
class FederationConfig:
    """Rounds, client sampling and local training (``federation.*``)."""

    rounds: int = checked(20, lambda v: v >= 0, "an integer >= 0", "R: rounds of training; rounds 0..R are evaluated")
    join_ratio: float = checked(
        1.0, lambda v: 0 < v <= 1, "a number in (0, 1]", "fraction of the clients sampled for training each round"
    )
    local_epochs: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "null or an integer >= 1",
        "local epochs per round (null: 1, or federation.local_steps when that is set)",
    )
    local_steps: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "null or an integer >= 1",
        "local SGD steps (mini-batches) per round in place of epochs, the same number for every client whatever "
        "its size, as FedProx, Self-FL and pFedMe train their baselines; the batch order runs on across epochs "
        "(null: federation.local_epochs)",
    )
    batch_size: int = checked(10, lambda v: v >= 1, "an integer >= 1", "mini-batch size of local training")
    drop_last: bool = documented(
        False,
        "leave out each local epoch's incomplete last batch, as PFLlib's loaders do (false: train on it, unless "
        "it is a single sample and the model has BatchNorm layers)",
    )
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
    unseen_clients: float = checked(
        0,
        lambda v: v == 0 or 0 < v < 1 or (v >= 1 and v == int(v)),
        "0, a fraction in (0, 1) or a whole count >= 1",
        "clients held out of the federation to measure how it serves new ones (pFL-Bench's unseen clients): a "
        "fraction of the clients (rounded, at least 1) or a count, chosen by the seed. They never train, send or "
        "count in an aggregation; at each evaluation each receives the model a newly joining client would "
        "(the method's new_client_model), fine-tuned for eval.finetune_epochs epochs, and is tested on its test split",
    )
    max_failed_clients: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 0,
        "null or an integer >= 0",
        "a client whose training raises or diverges is left out of its round; the round fails when more than "
        "this many fail (null: only when all do)",
    )
    system: SystemConfig = field(default_factory=SystemConfig)
    # One of plfl.executors' names; plfl.config checks it against them (they declare their own keys there).
    executor: str = documented(
        "sequential",
        "where client work runs: one client after another on one Lightning Trainer (sequential), a round's "
        "clients stacked and trained in lock-step with torch.func (vectorized), or a pool of Ray actors (ray)",
    )
    threads: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "null or an integer >= 1",
        "torch's CPU threads in the run's process (null: OMP_NUM_THREADS when set, else the CPUs the process may "
        "use, its core set and CPU quota counted, that are idle as the run starts; the run's config.yaml records "
        "the count, and a resumed run uses it); Ray actors take ray.num_cpus_per_actor each",
    )
    state_offload: bool = documented(
        False,
        "keep the clients' stored tensors (personalized models, statistics) in files under <run dir>/client-state "
        "instead of RAM: for many clients",
    )

    def local_length(self) -> dict[str, int]:
        """A round's local training as :class:`plfl.tasks.TrainTask` / ``StepTask`` keywords: ``{"steps":
        local_steps}``, or ``{"epochs": local_epochs}`` (1 when null)."""
        if self.local_steps is not None:
            return {"steps": self.local_steps}
        return {"epochs": self.local_epochs or 1}


@dataclass
class EvalConfig:
    """How clients outside the training are evaluated (``eval.*``)."""

    finetune_epochs: int = checked(
        0,
        lambda v: v >= 0,
        "an integer >= 0",
        "epochs an unseen client (federation.unseen_clients) trains on its own training split, from the model it "
        "receives, before it is tested, as PFLlib's new clients are (0: tested on the received model)",
    )


AGGREGATION_RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "norm_bound")
ATTACKS = ("none", "label_flip", "sign_flip", "scale", "gaussian", "backdoor")


@dataclass
class AggregationConfig:
    """How the server combines the client models it averages (``aggregation.*``): the weighted mean, or a rule
    robust to Byzantine clients (:mod:`plfl.robust`). Methods that aggregate by other means refuse every rule but
    ``mean``."""

    rule: str = one_of(
        "mean",
        AGGREGATION_RULES,
        "mean: the sample-weighted mean; median, trimmed_mean: coordinate-wise (Yin et al., ICML 2018); krum, "
        "multi_krum: the model(s) closest to their neighbours (Blanchard et al., NeurIPS 2017); norm_bound: each "
        "update clipped to aggregation.max_norm, then the weighted mean (Sun et al., 2019)",
    )
    trim: float = checked(
        0.1,
        lambda v: 0 <= v < 0.5,
        "a number in [0, 0.5)",
        "trimmed_mean: the fraction β of the clients' values dropped at each end of every coordinate",
    )
    byzantine: int = checked(
        1, lambda v: v >= 0, "an integer >= 0", "krum, multi_krum: f, the number of Byzantine clients assumed"
    )
    selected: int = checked(
        2, lambda v: v >= 1, "an integer >= 1", "multi_krum: m, the number of best-scored models averaged"
    )
    max_norm: float = checked(
        1.0,
        lambda v: v > 0,
        "a number > 0",
        "norm_bound: M, the largest L2 norm of a client's update θ_i − θ_sent (over every floating-point tensor)",
    )


@dataclass
class AttackConfig:
    """Poisoned clients (``attack.*``): a share of the participating clients, drawn once from the seed, that lie
    (:mod:`plfl.attacks`)."""

    kind: str = one_of(
        "none",
        ATTACKS,
        "none; label_flip: the malicious clients train on labels y → C − 1 − y; sign_flip, scale: they send "
        "θ_sent − λu or θ_sent + λu for their update u = θ_i − θ_sent; gaussian: θ_sent + N(0, σ²) noise; backdoor: "
        "they train on images with a trigger patch relabelled to attack.target",
    )
    fraction: float = checked(
        0.0,
        lambda v: 0 <= v < 1,
        "a number in [0, 1)",
        "the share of the participating clients that are malicious (rounded, at least 1 when above 0), chosen by "
        "federation.seed",
    )
    scale: float = checked(
        1.0, lambda v: v > 0, "a number > 0", "sign_flip, scale: λ, the factor of the malicious update"
    )
    noise_std: float = checked(1.0, lambda v: v > 0, "a number > 0", "gaussian: σ, the noise's standard deviation")
    target: int = checked(
        0, lambda v: v >= 0, "an integer >= 0", "backdoor: the class that triggered images are relabelled to"
    )
    poison_fraction: float = checked(
        0.5,
        lambda v: 0 < v <= 1,
        "a number in (0, 1]",
        "backdoor: the share of each malicious client's training images that carry the trigger (a 3×3 patch of "
        "the data's largest value in the bottom-right corner of every channel) and the target label",
    )


PRIVACY_LEVELS = ("none", "client", "sample")
ACCOUNTANTS = ("rdp", "prv")


@dataclass
class PrivacyConfig:
    """Differential privacy (``privacy.*``): at the client level, DP-FedAvg's clipped and noised mean of the
    clients' updates, with fixed or adaptive clipping; at the sample level, DP-SGD in every local step; ε from
    Opacus' accountant (:mod:`plfl.privacy`)."""

    level: str = one_of(
        "none",
        PRIVACY_LEVELS,
        "none; client: client-level DP (DP-FedAvg, McMahan et al., ICLR 2018): each round's client updates "
        "clipped to norm privacy.clip, averaged unweighted and noised; sample: sample-level DP (DP-SGD, Abadi et al., "
        "CCS 2016) in every local step of every client, per-sample gradients clipped to privacy.max_grad_norm and "
        "noised; both need Opacus (pip install 'plfl[privacy]')",
    )
    noise_multiplier: float = checked(
        1.0,
        lambda v: v > 0,
        "a number > 0",
        "client: z, the Gaussian noise's standard deviation over the clip norm (per scalar, z C / m for m uploads); "
        "sample: σ, the noise's standard deviation over privacy.max_grad_norm (per scalar, σ C / B for batch size "
        "B); with privacy.target_epsilon it is computed and must not be set",
    )
    clip: float = checked(
        1.0,
        lambda v: v > 0,
        "a number > 0",
        "client: C, the largest L2 norm of a client's update θ_i − θ_sent (over every floating-point tensor); with "
        "privacy.adaptive, the first round's",
    )
    adaptive: bool = documented(
        False,
        "client: adapt C each round toward the privacy.target_quantile of the update norms (Andrew et al., "
        "NeurIPS 2021)",
    )
    target_quantile: float = checked(
        0.5,
        lambda v: 0 < v < 1,
        "a number in (0, 1)",
        "adaptive: γ, the fraction of updates meant to be left unclipped",
    )
    clip_lr: float = checked(
        0.2, lambda v: v > 0, "a number > 0", "adaptive: η_C, the step of C ← C · exp(−η_C (b̄ − γ))"
    )
    quantile_noise: Optional[float] = checked(
        None,
        lambda v: v is None or v > 0,
        "null or a number > 0",
        "adaptive: σ_b, the noise's standard deviation on the count of unclipped updates; it must exceed "
        "privacy.noise_multiplier / 2 (null: m / 20 for m clients sampled per round, as Andrew et al.'s experiments)",
    )
    delta: float = checked(
        1e-5,
        lambda v: 0 < v < 1,
        "a number in (0, 1)",
        "client, sample: δ of the (ε, δ)-DP guarantee that ε is reported for",
    )
    accountant: str = one_of(
        "rdp",
        ACCOUNTANTS,
        "client, sample: Opacus' accountant of ε: rdp (Rényi DP) or prv (privacy loss random variables); both "
        "assume Poisson sampling (of clients; of samples)",
    )
    max_grad_norm: float = checked(
        1.0,
        lambda v: v > 0,
        "a number > 0",
        "sample: C, the largest L2 norm of a sample's gradient (over every trainable parameter) in DP-SGD",
    )
    target_epsilon: Optional[float] = checked(
        None,
        lambda v: v is None or v > 0,
        "null or a number > 0",
        "sample: the ε (at privacy.delta) that a client training in every round reaches after the last round; "
        "σ is then computed by Opacus' get_noise_multiplier (null: σ is privacy.noise_multiplier)",
    )


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


@dataclass(frozen=True)
class DPSGDNoise:
    """What every executor reads of sample-level DP (``privacy.level=sample``): DP-SGD's noise multiplier σ
    (``privacy.noise_multiplier``, or the one computed for ``privacy.target_epsilon``) and its per-sample clip
    norm C (``privacy.max_grad_norm``)."""

    noise_multiplier: float
    max_grad_norm: float
