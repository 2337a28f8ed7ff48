"""Export a small attention block and print its program: predispatch's main job in 30 lines.

    python examples/quickstart.py
"""

import time

import torch
import torch.nn.functional as F
from torch import nn

import predispatch


class Block(nn.Module):
    """Self-attention + MLP, with a step counter buffer and an optional attention mask."""

    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x, mask=None):
        self.steps += 1
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + attn.transpose(1, 2).reshape(b, t, d)
        return x + self.mlp(x)


def main() -> None:
    torch.manual_seed(0)
    model = Block()
    x, mask = torch.randn(2, 5, 16), torch.ones(5, 5, dtype=torch.bool).tril()
    start = time.perf_counter()
    ep = predispatch.export(model, (x,), {"mask": mask})
    elapsed = time.perf_counter() - start
    print(ep)
    program = ep.module()
    same = torch.equal(program(x, mask=mask), model(x, mask=mask))
    print(f"\nexport took {elapsed:.2f} s; program output equals eager: {same}")


if __name__ == "__main__":
    main()
