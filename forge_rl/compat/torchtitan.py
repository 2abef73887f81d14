"""torchtitan 0.2.2 internals: `tree_attention` swaps each sdpa Attention's causal `inner_attention(q, k, v,
scale=..., enable_gqa=...)` for one taking a boolean mask [B, 1, T, T] (True: may attend) within the context,
so a row can hold a tree of ids, each attending to its ancestors only (engines/titan/scoring.py)."""

import contextlib

from forge_rl.compat import require

require("torchtitan", "0.2.2", __name__)

import torch.nn.functional as F  # noqa: E402


@contextlib.contextmanager
def tree_attention(model, mask):
    inner = [layer.attention.inner_attention for layer in model.layers.values()]
    for module in inner:
        module.forward = lambda q, k, v, **kw: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    try:
        yield
    finally:
        for module in inner:
            del module.forward  # the class's causal forward again
