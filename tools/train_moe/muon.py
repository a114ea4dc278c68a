"""Muon (momentum + orthogonalised update) for weight matrices, batched over stacks of matrices.

torch.optim.Muon accepts 2-D parameters only; the expert weights here are stacks [n_expert, out, in]
(gate and up even share one stack, gate_up_proj [n_expert, 2 * n_ff, n_embd]). This optimiser treats
every matrix of a stack as its own parameter, which is what Muon means for them: each expert's gate,
up and down matrices get their own orthogonalised update.

Update for one matrix W (out x in) with gradient G:
  M <- momentum * M + G;  U <- G + momentum * M (Nesterov)
  O <- NewtonSchulz5(U)  (approximately the orthogonal polar factor of U: U = P S Q^T -> P Q^T)
  W <- W * (1 - lr * weight_decay) - lr * sqrt(max(1, out / in)) * O
Newton-Schulz uses the quintic coefficients (3.4445, -4.7750, 2.0315) published with Muon
(K. Jordan et al., 2024), which push all singular values into roughly [0.7, 1.2] in 5 steps.
"""

from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(update: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximate polar factor of every matrix in update [..., rows, cols] (float32)."""
    a, b, c = NS_COEFFICIENTS
    x = update.float()
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:  # iterate on the wide orientation: X X^T is then the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if transposed else x


class Muon(torch.optim.Optimizer):
    """params: a list of (tensor, split) where split is the number of equal row blocks each matrix of
    the tensor is cut into before orthogonalising (2 for gate_up_proj: gate rows, then up rows)."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0):
        tensors, splits = [], {}
        for tensor, split in params:
            tensors.append(tensor)
            splits[id(tensor)] = split
        super().__init__(tensors, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})
        self._splits = splits

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(param)
                buf = state["momentum"]
                buf.mul_(momentum).add_(param.grad)
                update = param.grad.add(buf, alpha=momentum)
                split = self._splits.get(id(param), 1)
                shape = update.shape
                # [..., split * r, c] -> [..., split, r, c]: each block is one matrix
                blocks = update.reshape(*shape[:-2], split, shape[-2] // split, shape[-1])
                ortho = orthogonalize(blocks).reshape(shape)
                rows, cols = shape[-2] // split, shape[-1]
                if decay:
                    param.mul_(1.0 - lr * decay)
                param.add_(ortho.to(param.dtype), alpha=-lr * math.sqrt(max(1.0, rows / cols)))
