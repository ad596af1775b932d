"""Ulysses attention over a long sequence through cuflux.torch.UlyssesAttention.

    q, k, v [B, T/W, heads, head_dim]   (this rank's tokens, every head)
      -> All2AllHeads scatter            [B, T, heads/W, head_dim]   (every token, W-th of heads)
      -> scaled_dot_product_attention (causal) over all T tokens
      -> All2AllHeads gather             [B, T/W, heads, head_dim]

Backward runs the inverse all-to-alls. Checks the output and the gradients of q, k and v against
scaled_dot_product_attention over the whole sequence on one GPU, and prints the time of both and
the speed-up. The default is 16k tokens in all with small heads, so the single-GPU reference
fits beside W ranks on one GPU. Run it with either launcher (heads and tokens divisible by W):

    mpirun -np 2 python scripts/examples/ulysses_long.py
    torchrun --nproc-per-node 2 scripts/examples/ulysses_long.py --tokens 65536

One rank per GPU gives the speed-up; ranks sharing one GPU check correctness only.
"""
import torch
import torch.nn.functional as F

from common import check_divides, finish, parser, rel_err, report, start, times
from cuflux.torch import UlyssesAttention, shard_rows


def sdpa(q, k, v):
    """Causal attention on [B, S, h, D] (scaled_dot_product_attention takes [B, h, S, D])."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def main() -> int:
    args = parser(__doc__, tokens=16384, iters=10, heads=8, head_dim=64, batch=1).parse_args()

    world, dev = start(args.tokens)
    W, me, bf16 = world.size, world.rank, torch.bfloat16
    T, nh, D, B = args.tokens, args.heads, args.head_dim, args.batch
    check_divides("--heads", nh, W)

    g = torch.Generator(device=dev).manual_seed(0)  # every rank draws the same full sequence
    q, k, v, grad = (torch.randn(B, T, nh, D, generator=g, device=dev, dtype=bf16)
                     for _ in range(4))
    rows = shard_rows(T, W, me)

    attn = UlyssesAttention(world, nh, D, max_tokens_per_rank=T // W, batch=B, dtype=bf16)
    mine = [t[:, rows].contiguous().requires_grad_() for t in (q, k, v)]

    def parallel():
        return attn(*mine, is_causal=True)

    full = [t.clone().requires_grad_() for t in (q, k, v)]

    def single():
        return sdpa(*full)

    # correctness: output and the gradients of q, k, v against attention over the whole sequence
    y = parallel()
    y.backward(grad[:, rows])
    y_ref = single()
    y_ref.backward(grad)
    errs = {"forward": rel_err(y, y_ref[:, rows])}
    errs.update({f"grad {name}": rel_err(t.grad, r.grad[:, rows])
                 for name, t, r in zip("qkv", mine, full)})

    ms = times(parallel, single, grad[:, rows], grad, args.iters)
    ok = report(world, f"Ulysses attention T={T} B={B} heads={nh} head_dim={D} causal bf16",
                errs, 3e-2, ms)
    finish(world, attn)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
