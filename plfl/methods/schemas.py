"""The ``method.*`` config schema of every method: one dataclass each, defaults from the papers.

Kept apart from the methods' code, which needs torch, so that a config is checked and
``plfl methods`` answers before anything heavy is imported. ``plfl.methods.METHODS``
names each method's schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from plfl.fields import checked, one_of


@dataclass
class ALAConfig:
    """ALA's hyperparameters (FedALA, Eq. 3–5; the reference code's defaults, the paper used threshold 0.01)."""

    s: float = checked(80.0, lambda v: 0 < v <= 100, "a percentage in (0, 100]",
                       "percentage of the client's training data used to learn the weights")
    p: int = checked(2, lambda v: v >= 1, "an integer >= 1",
                     "parameter tensors, counted from the end, that ALA aggregates element-wise")
    eta: float = checked(1.0, lambda v: v > 0, "a number > 0", "learning rate of the aggregation weights")
    threshold: float = checked(0.1, lambda v: v > 0, "a number > 0",
                               "the initial stage ends when the std of the last num_pre_loss epoch losses is below it")
    num_pre_loss: int = checked(10, lambda v: v >= 1, "an integer >= 1", "epoch losses the threshold looks at")
    max_init_epochs: int = checked(100, lambda v: v >= 1, "an integer >= 1",
                                   "cap on the initial stage's epochs (the reference has none and can hang)")


@dataclass
class MethodConfig:
    """Keys every method accepts (``method.*``)."""

    name: str = "fedavg"


@dataclass
class FedAvgConfig(MethodConfig):
    """FedAvg's keys; a method whose schema derives from this one can take ALA (``method.ala``)."""

    ala: Optional[ALAConfig] = field(default=None, metadata={
        "doc": "ALA as this method's local initialisation (FedALA paper, Table 4): method.ala.s, .p, ... "
               "take fedala's keys"})


@dataclass
class FedAvgMConfig(FedAvgConfig):
    """FedAvgM's keys (Hsu et al., 2019, Sec. 4.2); β = 0 with η_s = 1 is FedAvg. Derived from
    FedAvgConfig, so ``method.ala`` works here too."""

    name: str = "fedavgm"
    server_momentum: float = checked(0.9, lambda v: 0 <= v < 1, "a number in [0, 1)",
                                     "β: momentum of the server's update (the paper tried 0 to 0.997)")
    server_lr: float = checked(1.0, lambda v: v > 0, "a number > 0",
                               "η_s: the server's learning rate (the paper keeps it at 1)")


@dataclass
class LocalConfig(MethodConfig):
    name: str = "local"


@dataclass
class FedALAConfig(ALAConfig):
    """FedALA's keys are ALA's, at the top of ``method``: ``method.s``, ``method.p``, ..."""

    name: str = "fedala"


@dataclass
class FedFTHAConfig(MethodConfig):
    """τ_sync (Eq. 6) is ``federation.local_epochs``; τ_head (Eq. 7) is ``head_epochs``."""

    name: str = "fedftha"
    head_epochs: int = checked(5, lambda v: v >= 0, "an integer >= 0",
                               "τ_head: epochs of head-only training after the joint epochs, body frozen (Eq. 7)")


@dataclass
class FedFTConfig(FedFTHAConfig):
    name: str = "fedft"


@dataclass
class PFedLAConfig(MethodConfig):
    """pFedLA's keys (``method.*``); the hypernetwork's structure is the paper's."""

    name: str = "pfedla"
    embedding_dim: int = checked(100, lambda v: v >= 1, "an integer >= 1",
                                 "size of each client's embedding v_i, the hypernetwork's input")
    hidden_dim: int = checked(100, lambda v: v >= 1, "an integer >= 1",
                              "width of the hypernetwork's three hidden layers")
    hn_optimizer: str = one_of("adam", ("adam", "sgd"), "optimiser of v_i and ψ_i on Eq. 10–11's loss")
    hn_lr: float = checked(0.003, lambda v: v > 0, "a number > 0", "β of Eq. 10–11: step size of v_i and ψ_i")
    hn_weight_decay: float = checked(100.0, lambda v: v >= 0, "a number >= 0",
                                     "decoupled weight decay of the output heads: each step shrinks them by "
                                     "hn_lr × hn_weight_decay (0.3), keeping the logits near logit_bound")
    activation: str = one_of("softmax", ("softmax", "relu"),
                             "α from the hypernetwork's outputs: softmax, or the paper's ReLU / row sum (Eq. 3)")
    logit_bound: float = checked(3.0, lambda v: v > 0, "a number > 0",
                                 "R: softmax of R·tanh(output / R), so no weight is below e^(-2R) (1/403) "
                                 "times the largest of its row")
    granularity: str = one_of("module", ("module", "tensor"),
                              "what one weight α_i^{l,j} covers: a module's parameters, or one tensor")
    weights_every: int = checked(10, lambda v: v >= 1, "an integer >= 1",
                                 "write the weights α (tables/aggregation_weights.csv) every this many rounds")


@dataclass
class HeurpFedLAConfig(PFedLAConfig):
    name: str = "heurpfedla"
    k: int = checked(1, lambda v: v >= 0, "an integer >= 0",
                     "layers with the k largest self-weights stay local (Eq. 12); k = 0 is pFedLA")


@dataclass
class SelfFLConfig(MethodConfig):
    """Self-FL's keys; the local learning rate η of Eq. 8 is ``federation.lr``."""

    name: str = "selffl"
    init: str = one_of("loo", ("loo", "global"),
                       "start of local training: loo = global model without the client's share (Eq. 10), "
                       "global = ablation")
    l_min: int = checked(1, lambda v: v >= 1, "an integer >= 1", "lower clip of the local SGD steps l_m (Eq. 8)")
    l_max: int = checked(40, lambda v: v >= 1, "an integer >= 1",
                         "upper clip of the local SGD steps l_m (paper: 40, Sec. 4.2)")
    warmup_rounds: int = checked(2, lambda v: v >= 0, "an integer >= 0",
                                 "rounds of plain FedAvg before Self-FL's rules")
    eps: float = checked(1e-10, lambda v: v > 0, "a number > 0",
                         "floor of σ_m² and σ_0², so that the precisions stay finite")


@dataclass
class PerFedAvgConfig(MethodConfig):
    """Per-FedAvg's keys (Fallah et al., NeurIPS 2020, Algorithm 1 and Sec. 5). It evaluates a one-step
    adapted model from its own ``pre_local_init``, so it takes no ``method.ala``."""

    name: str = "perfedavg"
    variant: str = one_of("fo", ("fo", "hf"),
                          "fo: first-order step, Hessian term dropped; hf: with the exact Hessian-vector "
                          "product on a third batch D''")
    alpha: Optional[float] = checked(None, lambda v: v is None or v > 0, "null or a number > 0",
                                     "α: step size of the temporary step and of the evaluated one-step "
                                     "adaptation; null: federation.lr, as PFLlib (clientperavg.py)")
    beta: Optional[float] = checked(None, lambda v: v is None or v > 0, "null or a number > 0",
                                    "β: step size of the meta update; null: federation.lr, as PFLlib "
                                    "(clientperavg.py sets beta to the local learning rate)")
def proximal_mu() -> float:
    """FedProx's μ as a config field (one definition for fedprox and fedprox_c)."""
    return checked(0.01, lambda v: v >= 0, "a number >= 0",
                   "μ: weight of the proximal term μ/2‖w − w^t‖² (Eq. 2); 0.01 as in issue 14's PFLlib runs "
                   "(PFLlib's argparse default is 0, i.e. FedAvg); the FedProx code suggests tuning it in "
                   "{0.001, 0.01, 0.1, 0.5, 1}")


@dataclass
class FedProxConfig(FedAvgConfig):
    """FedProx's keys (Li et al., MLSys 2020); μ = 0 is FedAvg. Derived from FedAvgConfig, so
    ``method.ala`` works here too (FedALA paper, Table 4)."""

    name: str = "fedprox"
    mu: float = proximal_mu()


@dataclass
class FedAvgCConfig(MethodConfig):
    """FedAvg-C's keys (FedALA paper, Sec. 5). Its own local initialisation, so no ``method.ala``."""

    name: str = "fedavg_c"
    finetune_epochs: int = checked(1, lambda v: v >= 1, "an integer >= 1",
                                   "epochs of fine-tuning the received global model on the client's training "
                                   "data before evaluation and local training (the paper gives no value)")


@dataclass
class FedProxCConfig(FedAvgCConfig):
    """FedProx-C's keys: FedAvg-C's fine-tuning and FedProx's μ."""

    name: str = "fedprox_c"
    mu: float = proximal_mu()


@dataclass
class FedAvgEConfig(FedAvgConfig):
    """FedAvg-e's keys (Self-FL paper, Sec. 4): FedAvg's, ``method.ala`` included."""

    name: str = "fedavg_e"


@dataclass
class DittoConfig(MethodConfig):
    """Ditto's keys (Li et al., ICML 2021, Eq. 2, Alg. 1); the global copy trains for
    ``federation.local_epochs``. The kept personal model is Ditto's local initialisation, so
    there is no ``method.ala``."""

    name: str = "ditto"
    lam: float = checked(1.0, lambda v: v >= 0, "a number >= 0",
                         "λ: weight of λ/2‖v − w‖², the personal model's pull to the global one (Eq. 2); "
                         "1 as in the authors' scripts (PFLlib's shared -mu default 0 makes v a local model)")
    personal_epochs: int = checked(1, lambda v: v >= 1, "an integer >= 1",
                                   "epochs of the personal model per round (PFLlib's plocal_epochs, 1)")


@dataclass
class PFedMeConfig(MethodConfig):
    """pFedMe's keys (Dinh et al., NeurIPS 2020, Alg. 1); η of the local update is ``federation.lr``.
    The kept personalized model is pFedMe's local initialisation, so there is no ``method.ala``."""

    name: str = "pfedme"
    lam: float = checked(1.0, lambda v: v > 0, "a number > 0",
                         "λ: weight of λ/2‖θ − w‖² in the Moreau envelope (PFLlib's lamda, 1.0)")
    k: int = checked(5, lambda v: v >= 1, "an integer >= 1",
                     "K: gradient steps on each mini-batch's inner problem (PFLlib's K, 5)")
    personal_lr: float = checked(0.01, lambda v: v > 0, "a number > 0",
                                 "step size of the K inner steps (PFLlib's p_learning_rate, 0.01)")
    beta: float = checked(1.0, lambda v: v > 0, "a number > 0",
                          "β: the server moves Θ ← (1 − β) Θ + β · mean of the uploads; 1 = FedAvg's average "
                          "(PFLlib's shared -bt default 0 would never move Θ)")


@dataclass
class FedRepConfig(MethodConfig):
    """FedRep's keys; τ_φ (the body epochs) is ``federation.local_epochs``."""

    name: str = "fedrep"
    head_epochs: int = checked(1, lambda v: v >= 1, "an integer >= 1",
                               "τ_h: epochs of head-only training, body frozen, before the body epochs "
                               "(PFLlib's plocal_epochs default; the paper used 10)")


@dataclass
class LGFedAvgConfig(MethodConfig):
    """LG-FedAvg has no keys of its own: the head is shared, the body stays with the client."""

    name: str = "lgfedavg"


@dataclass
class FedBNConfig(MethodConfig):
    """FedBN has no keys of its own; it needs a model with BatchNorm layers (``model.batch_norm``)."""

    name: str = "fedbn"


@dataclass
class FedAMPConfig(MethodConfig):
    """FedAMP's keys (Huang et al., AAAI 2021, Eq. 6 and 8); defaults: PFLlib's (main.py). The client keeps
    and trains its own model, so there is no ``method.ala``."""

    name: str = "fedamp"
    alpha_k: float = checked(1.0, lambda v: v > 0, "a number > 0",
                             "α_K: step of the attentive message passing, ξ_ij = α_K e^(−‖w_i − w_j‖²/σ)/σ; "
                             "the proximal weight is λ/α_K (PFLlib's alphaK, 1.0)")
    sigma: float = checked(1.0, lambda v: v > 0, "a number > 0",
                           "σ: scale of the attention-inducing function A(x) = 1 − e^(−x/σ) "
                           "(PFLlib's sigma, 1.0)")
    lam: float = checked(1.0, lambda v: v >= 0, "a number >= 0",
                         "λ: the client trains on F_i(w) + λ/(2α_K)‖w − u_i‖² (PFLlib's lamda, 1.0)")


@dataclass
class FedFomoConfig(MethodConfig):
    """FedFomo's keys (Zhang et al., ICLR 2021, Sec. 3); defaults: PFLlib's. The client combines the
    downloaded models itself before training, so there is no ``method.ala``."""

    name: str = "fedfomo"
    m: int = checked(5, lambda v: v >= 1, "an integer >= 1",
                     "M: models of other clients each client downloads per round, those of the largest "
                     "affinity P_{i,n} (PFLlib's -M, 5)")
    val_ratio: float = checked(0.2, lambda v: 0 < v < 1, "a number in (0, 1)",
                               "share of each client's training split held out to score the downloaded models; "
                               "training uses the rest (PFLlib's clientfomo.py val_ratio, 0.2)")


@dataclass
class PFedHNConfig(MethodConfig):
    """pFedHN's keys (Shamsian et al., ICML 2021, Alg. 1); PFLlib has no pFedHN: defaults from the authors'
    code (AvivSham/pFedHN, experiments/pfedhn/trainer.py). The generated model is the client's local
    initialisation, so there is no ``method.ala``."""

    name: str = "pfedhn"
    embedding_dim: Optional[int] = checked(None, lambda v: v is None or v >= 1, "null or an integer >= 1",
                                           "size of each client's embedding v_i; null: int(1 + N/4), N clients "
                                           "(the authors' --embed-dim -1)")
    hidden_dim: int = checked(100, lambda v: v >= 1, "an integer >= 1",
                              "width of the hypernetwork's MLP (the authors' --hyper-hid, 100)")
    hidden_layers: int = checked(3, lambda v: v >= 0, "an integer >= 0",
                                 "(ReLU, Linear) blocks after the MLP's first Linear (the authors' --n-hidden, 3)")
    hn_lr: float = checked(0.01, lambda v: v > 0, "a number > 0",
                           "SGD step size of φ and the embeddings (the authors' --lr, 0.01)")
    hn_momentum: float = checked(0.9, lambda v: 0 <= v < 1, "a number in [0, 1)",
                                 "momentum of that SGD (the authors' 0.9)")
    hn_weight_decay: float = checked(1e-3, lambda v: v >= 0, "a number >= 0",
                                     "weight decay of that SGD (the authors' --wd, 1e-3)")
    max_grad_norm: Optional[float] = checked(50.0, lambda v: v is None or v > 0, "null or a number > 0",
                                             "clip the hypernetwork's gradient to this 2-norm; null: no clipping "
                                             "(the authors' 50)")


@dataclass
class APPLEConfig(MethodConfig):
    """APPLE's keys (Luo and Wu, IJCAI 2022). The core models step by ``federation.lr`` × N, as PFLlib's
    clientapple.py. Its personalized models are its own, so there is no ``method.ala``."""

    name: str = "apple"
    dr_lr: float = checked(0.001, lambda v: v >= 0, "a number >= 0",
                           "η_p: step size of the directed-relationship vector p_i (the authors' lr_coef, 0.001; "
                           "PFLlib's dr_learning_rate default 0 never moves p_i)")
    mu: float = checked(0.1, lambda v: v >= 0, "a number >= 0",
                        "μ: weight of λ(r) μ/2 ‖p_i − p_i^(0)‖² (the authors' --mu, 0.1, whose term has no ½; "
                        "PFLlib's shared -mu default 0 drops the term)")
    schedule_rounds: Optional[int] = checked(
        None, lambda v: v is None or v >= 0, "null or an integer >= 0",
        "L: λ(r) falls from 1 to 0 by a cosine over training rounds r = 0..L−1, then stays 0; null: "
        "federation.rounds, as PFLlib's -L default 1.0 (L = 1.0 × rounds; then extending a run by --resume "
        "moves L for the rounds still to come)")


@dataclass
class FedPHPConfig(MethodConfig):
    """FedPHP's keys (Li et al., ECML-PKDD 2021). The kept personalized model is FedPHP's own local
    initialisation, so there is no ``method.ala``."""

    name: str = "fedphp"
    mu: float = checked(0.9, lambda v: 0 <= v <= 1, "a number in [0, 1]",
                        "μ: the inheritance v_i ← μ_t v_i + (1 − μ_t) w uses μ_t = μ (t − 1) / T (the authors' "
                        "FedRepo rises to 0.9; PFLlib's shared -mu default 0 makes v_i the last local model)")
    lam: float = checked(0.1, lambda v: 0 <= v <= 1, "a number in [0, 1]",
                         "λ: local loss (1 − λ) CE + λ MMD² of the features of w and v_i (the authors' 0.1 with "
                         "MMD; PFLlib's shared -lam default 1 would leave no cross-entropy)")
    inheritance_rounds: Optional[int] = checked(
        None, lambda v: v is None or v >= 1, "null or an integer >= 1",
        "T: μ_t grows linearly to μ over T training rounds; null: federation.rounds, as PFLlib's μ / "
        "global_rounds × t (then extending a run by --resume changes T for the rounds still to come)")
