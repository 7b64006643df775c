"""LG-FedAvg (Liang et al., 2020, arXiv:2001.01523): local representations, a global head.

The mirror of FedRep: client i keeps its own body ℓ_i (the local representation, ``body.*``);
the head g (the last classifier layer, ``head.*``) is global. A sampled client
trains its whole model ℓ_i + g for ``federation.local_epochs`` epochs (the default
``local_train``) and uploads its head g_i; the server sets g^{t+1} = Σ_i n_i g_i / Σ_i n_i
over the sampled clients (``aggregate``, FedAvg's) and sends it to every client, which puts it
on its own body (``pre_local_init``; before its first round, the initial body). The evaluated
model is ℓ_i + g^{t+1}.

Departures, as PFLlib's clientlg.py/serverlg.py: the global part is the head alone and
training starts from the shared initial model. The authors' scripts start from a model
trained by FedAvg (``--load_fed``) and keep several top layers global (``--num_layers_keep``:
3 for their MNIST MLP, 2 for their CIFAR-10 CNN).
"""

from __future__ import annotations

from torch import nn

from plfl.methods.partial import PartialSharing, module_keys


class LGFedAvg(PartialSharing):
    """LG-FedAvg (Liang et al., 2020): local bodies, averaged head.

    FedAvg on the head; every client keeps its body.
    """

    name = "lgfedavg"

    def keep_local(self, model: nn.Module) -> frozenset[str]:
        return module_keys(model, lambda name, _: name == "body")
