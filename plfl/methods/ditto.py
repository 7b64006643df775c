"""Ditto (Li, Hu, Beirami and Smith, ICML 2021, arXiv:2012.04221): FedAvg plus personal models near the global one.

Client i solves min_v F_i(v) + λ/2 ‖v − w*‖², w* the global model that FedAvg learns (Eq. 2).
Per round (Alg. 1), a sampled client with the received global model w:

- personal model: v ← v − η (∇F_i(v) + λ (v − w)) per mini-batch, for ``method.personal_epochs``
  epochs from its own v (``local_train``: a :class:`~plfl.client.ProximalTerm` anchored at w,
  stream PERSONAL_TRAINING);
- global copy: FedAvg's local training from w for ``federation.local_epochs`` (stream
  LOCAL_TRAINING); it is what the client uploads (``TrainResult.upload``);
- server: FedAvg's sample-weighted average (inherited ``aggregate``).

v is the client's model in the store: ``pre_local_init`` keeps it, so v is what each client
evaluates; the global w is evaluated on all clients' test data (``global_accuracy``), as
PFLlib evaluates both. As PFLlib's ``serverditto.py``, the personal model trains first; both
trainings use the step size η = ``federation.lr``. Before its first training a client's v is
the initial global model, as PFLlib's copy of it. The reported loss is the cross-entropy
averaged over the steps of both trainings (the proximal term left out).
"""

from __future__ import annotations

from typing import Optional

from plfl.client import ProximalTerm, TrainResult
from plfl.executors import Trains
from plfl.methods.fedavg import FedAvg
from plfl.seeding import PERSONAL_TRAINING
from plfl.state import Params


class Ditto(FedAvg):
    """FedAvg's server and uploads; each client also keeps and evaluates a personal model v."""

    name = "ditto"

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Params:
        """The client's own v; before its first training, the received global model."""
        return self.store.get(client_id, "model") or {k: v.clone() for k, v in message.items()}

    def local_train(self, client_id: int, params: Params, round_: int) -> Trains[TrainResult]:
        """v (``params``) trained with λ/2‖v − w‖², then FedAvg's training of w, uploaded (Alg. 1)."""
        received = self.server_message(client_id)  # w: unchanged since this round's broadcast
        personal = yield self.train_task(client_id, params, round_, PERSONAL_TRAINING,
                                         epochs=self.config.personal_epochs,
                                         proximal=ProximalTerm(received, self.config.lam))
        global_copy = yield from super().local_train(client_id, received, round_)
        seen = personal.samples_seen + global_copy.samples_seen
        loss = (personal.loss * personal.samples_seen + global_copy.loss * global_copy.samples_seen) / seen
        return TrainResult(personal.params, loss, seen, upload=global_copy.params)

    def global_model(self) -> Params:
        return self.global_params
