"""A transformer MLP block with tensor + sequence parallelism through cuflux.torch.

    x_shard [T/W, hidden]  (this rank's tokens)
      -> ColumnParallelLinear (all-gather of the tokens hidden inside the GEMM)  [T, ffn/W]
      -> GELU
      -> RowParallelLinear    (reduce-scatter fused into the GEMM's epilogue)    [T/W, hidden]

Checks forward and backward against the same block run unsharded with torch on one GPU, and
prints the time of both and the speed-up. Run it with either launcher:

    mpirun -np 2 python scripts/examples/mlp_tp_sp.py
    torchrun --nproc-per-node 2 scripts/examples/mlp_tp_sp.py

One rank per GPU gives the speed-up; ranks sharing one GPU check correctness only.
"""
import torch
import torch.nn.functional as F

from common import finish, parser, rel_err, report, start, times
from cuflux.torch import ColumnParallelLinear, RowParallelLinear, shard_rows


def main() -> int:
    args = parser(__doc__, tokens=4096, hidden=4096, ffn=14336).parse_args()

    world, dev = start(args.tokens)
    W, me, bf16 = world.size, world.rank, torch.bfloat16
    T, H, F_ = args.tokens, args.hidden, args.ffn

    g = torch.Generator(device=dev).manual_seed(0)  # every rank draws the same full block
    x = torch.randn(T, H, generator=g, device=dev, dtype=bf16)
    w_up = (torch.randn(F_, H, generator=g, device=dev) * H ** -0.5).to(bf16)
    w_down = (torch.randn(H, F_, generator=g, device=dev) * F_ ** -0.5).to(bf16)
    grad = torch.randn(T, H, generator=g, device=dev, dtype=bf16)
    rows = shard_rows(T, W, me)

    up = ColumnParallelLinear(world, H, F_, max_tokens=T, dtype=bf16)
    down = RowParallelLinear(world, F_, H, max_tokens=T, dtype=bf16)
    up.load_full(w_up)
    down.load_full(w_down)
    x_shard = x[rows].contiguous().requires_grad_()

    def parallel():
        return down(F.gelu(up(x_shard)))

    x_full = x.clone().requires_grad_()
    w_up_full, w_down_full = w_up.clone().requires_grad_(), w_down.clone().requires_grad_()

    def single():
        return F.gelu(x_full @ w_up_full.T) @ w_down_full.T

    # correctness: forward and the gradients against the unsharded block
    y = parallel()
    y.backward(grad[rows])
    y_ref = single()
    y_ref.backward(grad)
    errs = {"forward": rel_err(y, y_ref[rows]),
            "grad x": rel_err(x_shard.grad, x_full.grad[rows]),
            "grad w_up": rel_err(up.weight.grad, w_up_full.grad[shard_rows(F_, W, me)]),
            "grad w_down": rel_err(down.weight.grad, w_down_full.grad[:, shard_rows(F_, W, me)])}

    ms = times(parallel, single, grad[rows], grad, args.iters)
    ok = report(world, f"MLP block T={T} hidden={H} ffn={F_} bf16", errs, 3e-2, ms)
    finish(world, up, down)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
