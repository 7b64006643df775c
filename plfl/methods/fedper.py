"""FedPer (Arivazhagan et al., 2019, arXiv:1912.00818): federated base layers, personalization layers per client.

The model is base layers (the body, ``body.*``) and personalization layers (the head, the last classifier layer,
``head.*``); the head never leaves client i. A sampled client trains its whole model, the received base under its
own head, for ``federation.local_epochs`` epochs of SGD (the default ``local_train``; Alg. 1's client update) and
uploads its base; the server sets the base to the sample-size weighted mean of the sampled clients' bases
(``aggregate``, FedAvg's) and sends it to every client, which puts it under its own head (``pre_local_init``;
before its first round, the initial head). The personalized model, the global base under client i's head, is what
is evaluated.

Where FedRep trains the head and the body in turn, FedPer trains them together; where LG-FedAvg keeps the body and
shares the head, FedPer does the opposite.

Departures, as PFLlib's clientper.py/serverper.py: the personalization layers are the last classifier layer alone
(the paper varies their number, K_P, from 1 to 4 top layers of its ResNets and MobileNet) and the server's mean is
weighted by the clients' training samples.
"""

from __future__ import annotations

from torch import nn

from plfl.methods.partial import PartialSharing, module_keys


class FedPer(PartialSharing):
    """FedPer (Arivazhagan et al., 2019): averaged base layers, a personal head per client.

    FedAvg on the body; every client keeps its head, trained with the body.
    """

    name = "fedper"

    def keep_local(self, model: nn.Module) -> frozenset[str]:
        return module_keys(model, lambda name, _: name == "head")
