"""Ditto (Li, Hu, Beirami and Smith, ICML 2021, arXiv:2012.04221): FedAvg plus personal models near the global one.

Client i solves min_v F_i(v) + λ/2 ‖v − w*‖², w* the global model that FedAvg learns (Eq. 2).
Per round (Alg. 1), a sampled client with the received global model w:

- personal model: v ← v − η (∇F_i(v) + λ (v − w)) per mini-batch from its own v (``local_train``: a
  :class:`~plfl.tasks.ProximalTerm` anchored at w, stream "personal_training"), for as long as the
  global copy trains (Alg. 1's s local iterations: ``federation.local_epochs`` or
  ``federation.local_steps``), or ``method.personal_epochs`` epochs when set;
- global copy: FedAvg's local training from w for ``federation.local_epochs`` or
  ``federation.local_steps`` (stream "local_training"); it is what the client uploads
  (``TrainResult.upload``);
- server: FedAvg's sample-weighted average (inherited ``aggregate``).

v is the client's model in the store: ``pre_local_init`` keeps it, so v is what each client
evaluates; the global w is evaluated on all clients' test data (``global_accuracy``), as
PFLlib evaluates both. As PFLlib's ``serverditto.py``, the personal model trains first; both
trainings use the step size η = ``federation.lr``. Before its first training a client's v is
the initial global model, as PFLlib's copy of it. The reported loss is the cross-entropy
averaged over the steps of both trainings (the proximal term left out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from plfl.fields import checked
from plfl.methods.base import MethodConfig
from plfl.methods.fedavg import FedAvg
from plfl.state import Params
from plfl.tasks import ProximalTerm, TrainResult, Work


@dataclass
class DittoConfig(MethodConfig):
    """Ditto's keys (Li et al., ICML 2021, Eq. 2, Alg. 1); the global copy trains for
    ``federation.local_epochs`` or ``federation.local_steps``. The kept personal model is Ditto's
    local initialisation, so there is no ``method.ala``."""

    lam: float = checked(
        1.0,
        lambda v: v >= 0,
        "a number >= 0",
        "λ: weight of λ/2‖v − w‖², the personal model's pull to the global one (Eq. 2); "
        "1 as in the authors' scripts (PFLlib's shared -mu default 0 makes v a local model)",
    )
    personal_epochs: Optional[int] = checked(
        None,
        lambda v: v is None or v >= 1,
        "null or an integer >= 1",
        "epochs of the personal model per round (PFLlib's plocal_epochs); null: as long as the global copy, "
        "federation.local_epochs or federation.local_steps (a fixed-steps protocol trains both for the same steps)",
    )


class Ditto(FedAvg):
    """Ditto (Li et al., ICML 2021): FedAvg plus a personal model kept near the global one.

    FedAvg's server and uploads; each client also keeps and evaluates a personal model v.
    """

    name = "ditto"
    config_class = DittoConfig

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params:
        """The client's own v; before its first training, the received global model."""
        return self.own_model(client_id, message)

    def local_train(self, client_id: int, params: Params, message: Params, round_: int) -> Work[TrainResult]:
        """v (``params``) trained with λ/2‖v − w‖², then FedAvg's training of w (the received ``message``),
        uploaded (Alg. 1)."""
        personal = yield self.train_task(
            client_id,
            params,
            round_,
            "personal_training",
            **self.personal_length(),
            proximal=ProximalTerm(message, self.config.lam),
        )
        global_copy = yield from super().local_train(client_id, message, message, round_)
        seen = personal.samples_seen + global_copy.samples_seen
        loss = (personal.loss * personal.samples_seen + global_copy.loss * global_copy.samples_seen) / seen
        return TrainResult(personal.params, loss, seen, upload=global_copy.params)

    def local_lengths(self) -> list[dict[str, float]]:
        """v's training and w's."""
        return [self.personal_length(), self.context.federation.local_length()]

    def personal_length(self) -> dict[str, int]:
        """The personal model's training per round as task keywords: ``method.personal_epochs``, else the
        federation's local length."""
        if self.config.personal_epochs is not None:
            return {"epochs": self.config.personal_epochs}
        return self.context.federation.local_length()

    def global_model(self, round_: int) -> Params:
        return self.global_params
