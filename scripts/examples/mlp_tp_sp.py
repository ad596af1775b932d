"""A transformer MLP block with tensor + sequence parallelism through cuflux.torch.

    x_shard [T/W, hidden]  (this rank's tokens)
      -> ColumnParallelLinear (all-gather of the tokens hidden inside the GEMM)  [T, ffn/W]
      -> GELU
      -> RowParallelLinear    (reduce-scatter fused into the GEMM's epilogue)    [T/W, hidden]

Checks forward and backward against the same block run unsharded with torch on one GPU, and
prints the time of both and the speed-up. Run it with either launcher:

    mpirun -np 2 python scripts/examples/mlp_tp_sp.py
    torchrun --nproc_per_node 2 scripts/examples/mlp_tp_sp.py

One rank per GPU gives the speed-up; ranks sharing one GPU check correctness only.
"""
import argparse

import torch
import torch.nn.functional as F

import cuflux
from cuflux.torch import ColumnParallelLinear, RowParallelLinear, shard_rows


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def rel_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="T, all ranks' tokens together")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()

    world = cuflux.init()  # mpirun or torchrun: read from the launcher's environment
    W, me = world.size, world.rank
    torch.cuda.set_device(world.device)
    dev, bf16 = torch.device("cuda", world.device), torch.bfloat16
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

    # correctness: forward and the input gradient against the unsharded block
    y = parallel()
    y.backward(grad[rows])
    y_ref = single()
    y_ref.backward(grad)
    errs = {"forward": rel_err(y, y_ref[rows]),
            "grad x": rel_err(x_shard.grad, x_full.grad[rows]),
            "grad w_up": rel_err(up.weight.grad, w_up_full.grad[shard_rows(F_, W, me)]),
            "grad w_down": rel_err(down.weight.grad, w_down_full.grad[:, shard_rows(F_, W, me)])}
    ok = all(e < 3e-2 for e in errs.values())

    def step(fn, g_out):
        def run():
            fn().backward(g_out)
        return run

    ms = {"forward": (time_ms(parallel, args.iters), time_ms(single, args.iters)),
          "forward+backward": (time_ms(step(parallel, grad[rows]), args.iters),
                               time_ms(step(single, grad), args.iters))}
    shared = any(link.same_gpu and link.peer != me for link in world.topology.links)
    results = world.allgather((errs, ok, ms))
    if me == 0:
        print(f"MLP block T={T} hidden={H} ffn={F_} bf16, W={W} "
              f"({'ranks share a GPU: times are not a speed-up' if shared else 'one GPU per rank'})")
        for r, (e, good, _) in enumerate(results):
            print(f"  rank {r}: " + ", ".join(f"{k} rel err {v:.2e}" for k, v in e.items())
                  + ("  OK" if good else "  MISMATCH"))
        for what in ms:
            par = max(res[2][what][0] for res in results)  # the slowest rank
            one = results[0][2][what][1]
            print(f"  {what:17s} cuflux W={W}: {par:8.3f} ms   torch 1 GPU: {one:8.3f} ms   "
                  f"speed-up {one / par:5.2f}x")
    up.close()
    down.close()
    world.close()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if all(good for _, good, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
