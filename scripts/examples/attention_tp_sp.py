"""A Llama-style attention block (grouped-query attention, rotary embeddings, causal) with tensor
+ sequence parallelism through cuflux.torch.

    x_shard [T/W, hidden]  (this rank's tokens)
      -> ColumnParallelLinear, QKV (all-gather of the tokens hidden in the GEMM)
                                   [T, (heads + 2 kv_heads) / W * head_dim]: this rank's heads
      -> rotary embedding on q, k; scaled_dot_product_attention (causal) on the local heads
                                   [T, heads / W * head_dim]
      -> RowParallelLinear, output projection (reduce-scatter in the GEMM's epilogue)
                                   [T/W, hidden]

Rank r holds query heads [r * heads / W, (r + 1) * heads / W) and the key / value heads they
use, so attention needs no communication: the full QKV weight is laid out rank by rank (each
rank's q rows, then its k rows, then its v rows) for ColumnParallelLinear's row split.

Checks forward and backward (grad of x, of the QKV weight and of the output weight) against the
same block run unsharded with torch on one GPU, and prints the time of both and the speed-up.
Run it with either launcher (heads, kv_heads and tokens divisible by W):

    mpirun -np 2 python scripts/examples/attention_tp_sp.py
    torchrun --nproc-per-node 2 scripts/examples/attention_tp_sp.py

One rank per GPU gives the speed-up; ranks sharing one GPU check correctness only.
"""
import torch
import torch.nn.functional as F

from common import check_divides, finish, parser, rel_err, report, start, times
from cuflux.torch import ColumnParallelLinear, RowParallelLinear, shard_rows


def rotary(T: int, head_dim: int, device, base: float = 10000.0):
    """cos, sin [T, head_dim] of the rotary embedding (Llama's, rotate-half form), bf16."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(T, device=device).float(), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)


def rope(t, cos, sin):
    """t [heads, T, head_dim] rotated by position."""
    t1, t2 = t.chunk(2, dim=-1)
    return t * cos + torch.cat([-t2, t1], dim=-1) * sin


def attend(qkv, heads: int, kv_heads: int, head_dim: int, cos, sin):
    """qkv [T, (heads + 2 kv_heads) * head_dim] -> causal GQA attention [T, heads * head_dim].
    The same code for the unsharded block (all heads) and a rank (its heads)."""
    T = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(T, n, head_dim).transpose(0, 1)
               for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    group = heads // kv_heads  # query head j reads key / value head j // group
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    return o.transpose(0, 1).reshape(T, heads * head_dim)


def by_rank(w_q, w_k, w_v, W: int):
    """The full QKV weight laid out for ColumnParallelLinear: for each rank r, the rows of its
    query heads, then of its key heads, then of its value heads."""
    return torch.cat([w[shard_rows(w.shape[0], W, r)] for r in range(W) for w in (w_q, w_k, w_v)])


def main() -> int:
    args = parser(__doc__, tokens=4096, hidden=2048, heads=16, kv_heads=8).parse_args()

    world, dev = start(args.tokens)
    W, me, bf16 = world.size, world.rank, torch.bfloat16
    T, H, nh, nkv = args.tokens, args.hidden, args.heads, args.kv_heads
    D = H // nh
    check_divides("--heads", nh, W)
    check_divides("--kv-heads", nkv, W)
    if H % nh or nh % nkv:
        raise SystemExit(f"--hidden={H} must be a multiple of --heads={nh}, and --heads of "
                         f"--kv-heads={nkv}")

    g = torch.Generator(device=dev).manual_seed(0)  # every rank draws the same full block
    x = torch.randn(T, H, generator=g, device=dev, dtype=bf16)
    w_q, w_k, w_v = ((torch.randn(n * D, H, generator=g, device=dev) * H ** -0.5).to(bf16)
                     for n in (nh, nkv, nkv))
    w_o = (torch.randn(H, nh * D, generator=g, device=dev) * (nh * D) ** -0.5).to(bf16)
    grad = torch.randn(T, H, generator=g, device=dev, dtype=bf16)
    cos, sin = rotary(T, D, dev)
    rows = shard_rows(T, W, me)

    qkv_out = (nh + 2 * nkv) * D
    qkv = ColumnParallelLinear(world, H, qkv_out, max_tokens=T, dtype=bf16)
    out = RowParallelLinear(world, nh * D, H, max_tokens=T, dtype=bf16)
    qkv.load_full(by_rank(w_q, w_k, w_v, W))
    out.load_full(w_o)
    x_shard = x[rows].contiguous().requires_grad_()

    def parallel():
        return out(attend(qkv(x_shard), nh // W, nkv // W, D, cos, sin))

    x_full = x.clone().requires_grad_()
    ref = [w.clone().requires_grad_() for w in (w_q, w_k, w_v, w_o)]

    def single():
        return attend(x_full @ torch.cat(ref[:3]).T, nh, nkv, D, cos, sin) @ ref[3].T

    # correctness: forward and the gradients against the unsharded block
    y = parallel()
    y.backward(grad[rows])
    y_ref = single()
    y_ref.backward(grad)
    grad_qkv = by_rank(*(w.grad for w in ref[:3]), W)[shard_rows(qkv_out, W, me)]
    errs = {"forward": rel_err(y, y_ref[rows]),
            "grad x": rel_err(x_shard.grad, x_full.grad[rows]),
            "grad w_qkv": rel_err(qkv.weight.grad, grad_qkv),
            "grad w_o": rel_err(out.weight.grad, ref[3].grad[:, shard_rows(nh * D, W, me)])}

    ms = times(parallel, single, grad[rows], grad, args.iters)
    ok = report(world, f"attention block T={T} hidden={H} heads={nh} kv_heads={nkv} bf16", errs,
                3e-2, ms)
    finish(world, qkv, out)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
