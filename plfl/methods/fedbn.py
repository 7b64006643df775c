"""FedBN (Li et al., ICLR 2021, arXiv:2102.07623): FedAvg with every BatchNorm layer kept local.

Client i trains its whole model for ``federation.local_epochs`` epochs (the default
``local_train``). Its BatchNorm layers' affine parameters (γ, β) and running statistics
(mean, variance, batch count) never leave it: they are not uploaded, not averaged, and not
overwritten when the averaged model arrives (Alg. 1). Every other key is FedAvg's:
Θ^{t+1} = Σ_i n_i Θ_i / Σ_i n_i over the sampled clients (``aggregate``), sent to every
client and put under its own BatchNorm layers (``pre_local_init``; before its first round,
the initial ones). The evaluated model is the client's.

BatchNorm layers are the modules that are ``torch.nn.modules.batchnorm._BatchNorm``
instances (BatchNorm1d/2d/3d, SyncBatchNorm); PFLlib's clientbn.py keeps the parameters whose
name contains "bn" instead, and sends no buffers at all. The paper's Alg. 1 averages with
equal weights; plfl weights by training samples, as FedAvg and PFLlib do. FedBN needs a model
with BatchNorm layers (``model.batch_norm=true``, or ``model.name=resnet18``).
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from plfl.errors import ConfigError
from plfl.methods.partial import PartialSharing, module_keys


class FedBN(PartialSharing):
    """FedBN (Li et al., ICLR 2021): FedAvg with BatchNorm layers kept local.

    FedAvg on every key outside the BatchNorm layers.
    """

    name = "fedbn"
    # The executor matrix: its BatchNorm model.
    matrix_options = {"model.batch_norm": True}

    def keep_local(self, model: nn.Module) -> frozenset[str]:
        """The BatchNorm layers' keys.

        Raises:
            ConfigError: the model has no BatchNorm layer (FedBN would be FedAvg).
        """
        keys = module_keys(model, lambda _, module: isinstance(module, _BatchNorm))
        if not keys:
            raise ConfigError(
                "method.name=fedbn keeps the BatchNorm layers local, but the model has none. Set "
                "model.batch_norm=true (model.name=cnn or mlp), or use method.name=fedavg."
            )
        return keys
