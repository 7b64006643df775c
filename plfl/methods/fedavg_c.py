"""FedAvg-C (FedALA paper: Zhang et al., AAAI 2023, arXiv:2212.01197, Sec. 5): FedAvg that fine-tunes the
received global model locally as local initialisation (FedProx-C: :mod:`plfl.methods.fedprox_c`).

Sec. 5 describes the two baselines in one sentence: they "locally fine-tune the global model
for local initialization at each iteration". Here, after every broadcast (round 0 included),
each client's model is the received global model Θ^t trained on its own training split for
``method.finetune_epochs`` epochs of plain SGD (``pre_local_init``, seed stream
"fine_tuning"); that fine-tuned model is evaluated, and the next round's local training
starts from it. FedAvg-C then trains as FedAvg does, FedProx-C with FedProx's proximal term
μ/2 ‖w − Θ^t‖², anchored at the received Θ^t, not at the fine-tuned model. Both servers are
FedAvg's. Choices the paper leaves open: the number of fine-tuning epochs (default 1) and
that FedProx-C's fine-tuning has no proximal term (it adapts to the client's data only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from plfl.fields import checked
from plfl.methods.base import Method, MethodConfig
from plfl.methods.fedavg import FedAvg
from plfl.state import Params
from plfl.tasks import Work


@dataclass
class FedAvgCConfig(MethodConfig):
    """FedAvg-C's keys (FedALA paper, Sec. 5). Its own local initialisation, so no ``method.ala``."""

    finetune_epochs: int = checked(
        1,
        lambda v: v >= 1,
        "an integer >= 1",
        "epochs of fine-tuning the received global model on the client's training "
        "data before evaluation and local training (the paper gives no value)",
    )


class FineTunedInit(Method):
    """Mixin: local initialisation by fine-tuning the received model for
    ``config.finetune_epochs`` epochs on the client's training split (put it first in the bases)."""

    def pre_local_init(self, client_id: int, message: Optional[Params], round_: int) -> Work[Params]:
        """The received global model after ``finetune_epochs`` epochs on the client's data (Sec. 5)."""
        tuned = yield self.train_task(client_id, message, round_, "fine_tuning", epochs=self.config.finetune_epochs)
        return tuned.params


class FedAvgC(FineTunedInit, FedAvg):
    """FedAvg-C (FedALA paper, AAAI 2023): FedAvg, global model fine-tuned locally as init.

    FedAvg whose clients start from (and are evaluated with) the fine-tuned global model.
    """

    name = "fedavg_c"
    config_class = FedAvgCConfig
