"""FedFT (FedFTHA paper, IEEE IoT-J 2023, Eq. 5–7): FedFTHA (:mod:`plfl.methods.fedftha`) without the server's
head aggregation: every client fine-tunes and keeps its own head, the server averages the bodies."""

from __future__ import annotations

from plfl.methods.fedftha import FedFTHA
from plfl.state import Params


class FedFT(FedFTHA):
    """FedFT (FedFTHA paper, IEEE IoT-J 2023): personal heads fine-tuned, body averaged.

    FedFTHA without head aggregation: clients that never trained keep the initial head,
    and there is no global model to evaluate.
    """

    name = "fedft"

    def global_head(self) -> Params:
        return {k: self.global_params[k] for k in self.head_keys}

    def global_model(self, round_: int) -> None:
        return None
