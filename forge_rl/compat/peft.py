"""peft 0.21 internals: a plain LoRA linear layer computed as one autograd node.

PEFT's `lora.Linear.forward` computes base(x) + B(A(dropout(x))) * scale as separate operations, each
writing a tensor of the layer's whole output [tokens, out]: B's product, the multiply by the scale, the
sum; autograd adds a multiply in the backward and sums x's two gradients in one more pass. Those passes
over memory (and their fresh allocations) are most of what LoRA adds to a step, and on a host with fast
matmuls they cost more than the base layer's weight gradient saves: a LoRA step ran slower than a full
one. `fuse_lora_layers` gives each plain LoRA linear layer a forward whose adapter product is accumulated
into the base output inside the matmul (`addmm_`, the scale as its alpha), and whose backward does the
same for x's gradient: the same sums, with no pass over a [tokens, out] tensor beyond the matmuls'.

It reads a layer's `base_layer`, `lora_A`, `lora_B`, `scaling`, `lora_dropout`, `lora_variant`,
`merged`, `disable_adapters` and `active_adapters`; anything else (dropout, DoRA and other variants,
several active adapters, adapters merged or off, extra arguments) takes PEFT's own forward.
"""

from __future__ import annotations

import types

from forge_rl.compat import require

require("peft", "0.21.0", __name__)

import torch  # noqa: E402
from peft.tuners.lora import Linear  # noqa: E402


class _LoraLinear(torch.autograd.Function):
    """y = x W^T + bias + scale (x A^T) B^T on 2-D x; W and bias frozen or not, as their requires_grad say."""

    @staticmethod
    def forward(ctx, x, weight, bias, a, b, scale):
        low = x @ a.t()  # [tokens, r]
        out = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())
        out.addmm_(low, b.t(), alpha=scale)
        ctx.save_for_backward(x, weight, a, b, low)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, a, b, low = ctx.saved_tensors
        need_x, need_w, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        grad_low = (grad @ b).mul_(ctx.scale)  # [tokens, r]
        grad_x = grad_w = grad_bias = grad_a = grad_b = None
        if need_x:
            grad_x = (grad @ weight).addmm_(grad_low, a)
        if need_w:
            grad_w = grad.t() @ x
        if need_bias:
            grad_bias = grad.sum(0)
        if need_a:
            grad_a = grad_low.t() @ x
        if need_b:
            grad_b = (grad.t() @ low).mul_(ctx.scale)
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None


def _fused_forward(self: Linear, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    names = self.active_adapters
    plain = len(names) == 1 and names[0] not in self.lora_variant and isinstance(self.lora_dropout[names[0]], torch.nn.Identity)
    if args or kwargs or self.disable_adapters or self.merged or not plain:
        return Linear.forward(self, x, *args, **kwargs)
    name = names[0]
    base = self.base_layer
    tensors = [x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight]
    device = x.device.type
    if torch.is_autocast_enabled(device):  # what autocast would run F.linear in
        dtype = torch.get_autocast_dtype(device)
        tensors = [t if t is None else t.to(dtype) for t in tensors]
    x2 = tensors[0].reshape(-1, x.shape[-1])
    with torch.autocast(device, enabled=False):
        out = _LoraLinear.apply(x2, *tensors[1:], self.scaling[name])
    return out.view(*x.shape[:-1], out.shape[-1])


def fuse_lora_layers(model: torch.nn.Module) -> int:
    """Every PEFT LoRA linear layer of `model` computes itself as one autograd node; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in layers:
        layer.forward = types.MethodType(_fused_forward, layer)
    return len(layers)
