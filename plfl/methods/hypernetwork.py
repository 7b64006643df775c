"""The server-side hypernetwork step shared by pFedLA and pFedHN.

Both methods generate what a client trains from with a hypernetwork (pFedLA: the
aggregation weights α_i; pFedHN: the whole model θ_i) and, once the client has trained,
move the hypernetwork's parameters ψ down ½‖g(ψ) − θ^new‖², g(ψ) the generated tensors
and θ^new the client's trained ones. Its gradient is (∂g/∂ψ)ᵀ (g(ψ) − θ^new): a
vector–Jacobian product, which ``torch.autograd.grad`` computes with ``grad_outputs``
without forming the loss.
"""

from __future__ import annotations

from typing import Optional

import torch


def descend(
    outputs: list[torch.Tensor],
    directions: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    max_grad_norm: Optional[float] = None,
) -> None:
    """One ``optimizer`` step on its parameters ψ along (∂outputs/∂ψ)ᵀ · directions.

    Args:
        outputs: tensors computed from the optimizer's parameters with autograd (g(ψ)).
        directions: one tensor per output, of its shape: g(ψ) − θ^new for the step down
            ½‖g(ψ) − θ^new‖².
        optimizer: holds ψ (every parameter must reach some output).
        max_grad_norm: clip the gradient's total 2-norm to this (pFedHN's authors: 50); None: no clipping.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = torch.autograd.grad(outputs, params, grad_outputs=directions)
    for p, g in zip(params, grads):
        p.grad = g
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
