"""Training steps (forward + backward + AdamW) of a small model built from cuflux.torch's
modules, with tensor + sequence parallelism, checked against the same model on one GPU.

The model: `blocks` pre-norm MLP blocks on a residual stream that stays sequence parallel
(each rank holds its T/W tokens of it):

    n, res = norm_0(0, x_shard)                         ParallelRMSNorm, "sequence_parallel"
    for each block i:
        a = GELU(ColumnParallelLinear_i(n))             [T, ffn/W]  all-gather in the GEMM
        partial = a @ W_down_i^T                        [T, hidden] this rank's partial sums
        n, res = norm_{i+1}(partial, res)               res += sum_ranks(partial) (reduce-
                                                        scatter), n = RMSNorm(res): one kernel
    loss = sum over all tokens of (n - target)^2 / (T * hidden)

The down projection is the row-parallel GEMM without its reduction: the next norm's fused
all-reduce + residual add + RMSNorm (AllReduceRMSNorm) does it. Backward: the norms all-gather
the gradient of the partial sums and all-reduce their weights' gradients; AdamW then steps every
rank's shards (and the replicated norm weights, with the same full gradient on every rank).
Every step the loss (summed over the ranks) is checked against the unsharded model, run by
torch on one GPU from the same initial weights on the same batch.

    mpirun -np 2 python scripts/examples/train_step.py
    torchrun --nproc-per-node 2 scripts/examples/train_step.py --blocks 4 --steps 10

One rank per GPU gives the speed-up; ranks sharing one GPU check correctness only.
"""
import torch
import torch.nn.functional as F
from torch import nn

from common import finish, parser, rel_err, report, start, time_ms
from cuflux.torch import ColumnParallelLinear, ParallelRMSNorm, shard_rows

EPS = 1e-6


class ParallelModel(nn.Module):
    """This rank's part of the model: x_shard [T/W, hidden] -> n [T/W, hidden]."""

    def __init__(self, world, full: dict, tokens: int):
        super().__init__()
        W, me = world.size, world.rank
        hidden, ffn = full["up"][0].shape[1], full["up"][0].shape[0]
        bf16 = torch.bfloat16
        self.norms = nn.ModuleList(
            ParallelRMSNorm(world, hidden, max_tokens=tokens, eps=EPS, dtype=bf16,
                            output="sequence_parallel") for _ in full["norm"])
        self.ups = nn.ModuleList(
            ColumnParallelLinear(world, hidden, ffn, max_tokens=tokens, dtype=bf16)
            for _ in full["up"])
        cols = shard_rows(ffn, W, me)
        self.downs = nn.ParameterList(nn.Parameter(w[:, cols].clone()) for w in full["down"])
        with torch.no_grad():
            for norm, w in zip(self.norms, full["norm"]):
                norm.weight.copy_(w)
            for up, w in zip(self.ups, full["up"]):
                up.load_full(w)
        self.tokens = tokens

    def forward(self, x_shard):
        # The first norm has no partial sums to add: zeros, the residual is the input.
        n, res = self.norms[0](x_shard.new_zeros(self.tokens, x_shard.shape[1]), x_shard)
        for up, down, norm in zip(self.ups, self.downs, self.norms[1:]):
            n, res = norm(F.gelu(up(n)) @ down.T, res)
        return n

    def close(self):
        for layer in (*self.norms, *self.ups):
            layer.close()


def rmsnorm(h, w):
    h32 = h.float()
    return (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(h.dtype)


class SingleModel(nn.Module):
    """The same model unsharded, in plain torch: x [T, hidden] -> n [T, hidden]."""

    def __init__(self, full: dict):
        super().__init__()
        self.norms = nn.ParameterList(nn.Parameter(w.clone()) for w in full["norm"])
        self.ups = nn.ParameterList(nn.Parameter(w.clone()) for w in full["up"])
        self.downs = nn.ParameterList(nn.Parameter(w.clone()) for w in full["down"])

    def forward(self, x):
        res, n = x, rmsnorm(x, self.norms[0])
        for up, down, norm in zip(self.ups, self.downs, self.norms[1:]):
            res = res + F.gelu(n @ up.T) @ down.T
            n = rmsnorm(res, norm)
        return n


def loss_sum(out, target, num_elems: int):
    """sum (out - target)^2 / num_elems, in fp32 (a rank's share: its tokens)."""
    return (out.float() - target.float()).pow(2).sum() / num_elems


def main() -> int:
    p = parser(__doc__, tokens=2048, iters=5, hidden=1024, ffn=4096, blocks=2)
    p.add_argument("--steps", type=int, default=5, help="checked training steps")
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()

    world, dev = start(args.tokens)
    W, me, bf16 = world.size, world.rank, torch.bfloat16
    T, H, F_, L = args.tokens, args.hidden, args.ffn, args.blocks

    g = torch.Generator(device=dev).manual_seed(0)  # every rank draws the same model and data

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(bf16)

    full = {"norm": [1 + draw(H, scale=0.1) for _ in range(L + 1)],
            "up": [draw(F_, H, scale=H ** -0.5) for _ in range(L)],
            "down": [draw(H, F_, scale=F_ ** -0.5) for _ in range(L)]}
    x, target = draw(T, H), draw(T, H)  # one batch, used at every step
    rows = shard_rows(T, W, me)
    x_shard, target_shard = x[rows].contiguous(), target[rows]

    model, single = ParallelModel(world, full, T), SingleModel(full)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    opt_single = torch.optim.AdamW(single.parameters(), lr=args.lr)

    def backward_parallel():
        opt.zero_grad(set_to_none=True)
        loss = loss_sum(model(x_shard), target_shard, T * H)  # this rank's tokens' share
        loss.backward()
        return loss

    def backward_single():
        opt_single.zero_grad(set_to_none=True)
        loss = loss_sum(single(x), target, T * H)
        loss.backward()
        return loss

    def step_parallel():
        loss = backward_parallel()
        opt.step()
        return loss

    def step_single():
        loss = backward_single()
        opt_single.step()
        return loss

    # The first step's gradients, every parameter: this rank's shards against the rows or
    # columns of the full model's, the norm weights (replicated) against the full gradient.
    backward_parallel(), backward_single()
    cols = shard_rows(F_, W, me)
    errs = {"grad norms": max(rel_err(a.weight.grad, b.grad)
                              for a, b in zip(model.norms, single.norms)),
            "grad ups": max(rel_err(a.weight.grad, b.grad[cols])
                            for a, b in zip(model.ups, single.ups)),
            "grad downs": max(rel_err(a.grad, b.grad[:, cols])
                              for a, b in zip(model.downs, single.downs))}

    losses = []
    for s in range(args.steps):
        mine, ref = step_parallel().item(), step_single().item()
        total = sum(world.allgather(mine))  # the loss: every rank's share
        losses.append((total, ref))
        errs[f"loss {s}"] = abs(total - ref) / abs(ref)
    if me == 0:
        print("loss per step (cuflux W ranks / torch 1 GPU): "
              + ", ".join(f"{a:.5f}/{b:.5f}" for a, b in losses))
    # The replicated norm weights took the same steps on every rank: bit-identical.
    norms = world.allgather([n.weight.detach().cpu() for n in model.norms])
    errs["norm weights vs rank 0"] = max(rel_err(a, b) for r in norms for a, b in zip(r, norms[0]))

    ms = {"train step": (time_ms(step_parallel, args.iters), time_ms(step_single, args.iters))}
    ok = report(world, f"{L} MLP blocks T={T} hidden={H} ffn={F_} bf16, AdamW", errs, 3e-2, ms)
    model.close()
    finish(world)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
