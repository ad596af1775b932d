"""cuflux.torch: tensor- and sequence-parallel layers for PyTorch, forward and backward through
cuflux's ops (optional: needs torch).

Shapes (W ranks of a World, T tokens in all, each rank holding T / W of them in order: rank r
has tokens [r * T / W, (r + 1) * T / W), the sequence-parallel layout of Megatron-LM):

  ColumnParallelLinear  x_shard [T/W, in] -> y [T, out/W]        forward  AllGatherGemm
                        backward: grad_x_shard = reduce-scatter(grad_y @ W_r)  GemmReduceScatter
                                  grad_W_r = grad_y^T @ gathered x (kept from forward)
  RowParallelLinear     x [T, in/W] -> y_shard [T/W, out]         forward  GemmReduceScatter
                        backward: grad_y = all-gather(grad_y_shard)  AllGather, then GEMMs
  ParallelRMSNorm       x [T, H] partial sums -> RMSNorm(sum_ranks(x) + residual) * weight,
                        and the new residual (AllReduceRMSNorm), out and residual replicated
                        or sharded by token; backward: local norm backward on the tokens a
                        rank holds; sharded modes: AllGather of grad x, AllReduce of grad w
  UlyssesAttention      q, k, v [B, T/W, H, D] -> attention over all T tokens with H/W heads
                        per rank -> [B, T/W, H, D] (All2AllHeads around any attention function)

The GEMM layers run in bfloat16 or float16 (fp32 accumulation), the limits of cuflux's GEMM
cores; T must be a multiple of W and <= max_tokens; feature sizes multiples of 8 (per rank).
Every rank builds the same layers in the same order (the constructors are collective) and runs
them in the same order; `close()` (or `with`) frees their ops, collectively. Work is queued on
torch's current stream. The local GEMMs of the backward passes are torch's (cuBLAS).
"""
from __future__ import annotations

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as _e:  # pragma: no cover - exercised by the CPU test in a subprocess
    raise ImportError(f"cuflux.torch needs PyTorch, which cannot be imported ({_e}): "
                      "pip install torch") from _e

import cuflux
from cuflux.ops.allreduce import token_slice
from cuflux.ops.base import DEFAULT_TIMEOUT_S

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelRMSNorm", "UlyssesAttention",
           "check_linear_args", "shard_rows"]

_GEMM_DTYPES = (torch.bfloat16, torch.float16)


def _plain(t):
    """What a cuflux op takes: contiguous, detached (DLPack refuses tensors that require
    grad; autograd is this module's business)."""
    return None if t is None else t.detach().contiguous()


def _torch(a):
    """A CuPy array (the GEMM ops' outputs) as a torch tensor, no copy."""
    return a if isinstance(a, torch.Tensor) else torch.from_dlpack(a)


def shard_rows(num_tokens: int, world_size: int, rank: int) -> slice:
    """Tokens of `rank` in the sequence-parallel layout: [r * T / W, (r + 1) * T / W)."""
    n = num_tokens // world_size
    return slice(rank * n, (rank + 1) * n)


def check_linear_args(layer: str, world_size: int, in_features, out_features, max_tokens,
                      dtype, split: str) -> tuple[int, int]:
    """Argument checks of the parallel Linear layers (pure: tested on the CPU). split: "out"
    (column-parallel: out_features divided between the ranks) or "in" (row-parallel). Returns
    (this rank's in_features, out_features)."""
    for name, v in (("in_features", in_features), ("out_features", out_features),
                    ("max_tokens", max_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{layer}: {name} must be an int >= 1, got {v!r}")
    if dtype not in _GEMM_DTYPES:
        raise TypeError(f"{layer}: dtype must be torch.bfloat16 or torch.float16 (cuflux's GEMM "
                        f"cores), got {dtype}")
    split_name = "out_features" if split == "out" else "in_features"
    full = out_features if split == "out" else in_features
    if full % world_size:
        raise ValueError(f"{layer}: {split_name}={full} must be divisible by the world size "
                         f"{world_size}")
    local_in = in_features if split == "out" else in_features // world_size
    local_out = out_features // world_size if split == "out" else out_features
    for name, v in (("in_features per rank", local_in), ("out_features per rank", local_out)):
        if v % 8:
            raise ValueError(f"{layer}: {name} = {v} must be a multiple of 8 (rows move in "
                             "16-byte pieces)")
    if max_tokens % world_size:
        raise ValueError(f"{layer}: max_tokens={max_tokens} must be a multiple of the world "
                         f"size {world_size}")
    return local_in, local_out


def _check_tokens(layer: str, num_tokens: int, world, max_tokens: int) -> None:
    if num_tokens % world.size or num_tokens > max_tokens:
        raise ValueError(f"{layer}: the call has T={num_tokens} tokens in all; T must be a "
                         f"multiple of the world size {world.size} and <= max_tokens="
                         f"{max_tokens}")


class _Layer(nn.Module):
    """Owns cuflux ops: close() (collective, idempotent) frees them; a context manager."""

    def __init__(self, world):
        super().__init__()
        self.world = world
        self._ops: list = []

    def _own(self, op):
        self._ops.append(op)
        return op

    def close(self) -> None:
        while self._ops:
            self._ops.pop().close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _device(world):
    return torch.device("cuda", world.device)


class _ParallelLinear(_Layer):
    """A tensor-parallel nn.Linear: the arguments, this rank's weight shard and bias; the
    subclass says how the weight is split (SPLIT) and builds its ops (_build)."""

    SPLIT = ""  # "out": column parallel, "in": row parallel

    def __init__(self, world, in_features: int, out_features: int, max_tokens: int,
                 bias: bool = False, dtype=torch.bfloat16,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__(world)
        kind = type(self).__name__
        local_in, local_out = check_linear_args(kind, world.size, in_features, out_features,
                                                max_tokens, dtype, self.SPLIT)
        self.in_features, self.out_features = in_features, out_features
        self.max_tokens = max_tokens
        dev = _device(world)
        # This rank's shard (Kaiming-uniform, as nn.Linear) and bias (zeros: [out/W] column
        # parallel, [out] row parallel).
        self.weight = nn.Parameter(torch.empty(local_out, local_in, dtype=dtype, device=dev))
        self.bias = (nn.Parameter(torch.zeros(local_out, dtype=dtype, device=dev)) if bias
                     else None)
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)
        self._dtype, self._timeout_s = dtype_name(dtype), timeout_s
        self._build(local_in, local_out)

    def _build(self, local_in: int, local_out: int) -> None:
        raise NotImplementedError

    def _op(self, cls, **sizes):
        """One of this layer's cuflux ops (closed with it), in the layer's dtype and timeout."""
        return self._own(cls(self.world, dtype=self._dtype, timeout_s=self._timeout_s, **sizes))

    @torch.no_grad()
    def load_full(self, weight, bias=None) -> None:
        """Take this rank's shard of the full layer's weight [out, in] and bias [out]: its rows
        (and the bias's) for a column-parallel layer, its columns (and the whole bias, added
        once after the sum) for a row-parallel one."""
        by_rows = self.SPLIT == "out"
        part = shard_rows(self.out_features if by_rows else self.in_features, self.world.size,
                          self.world.rank)
        self.weight.copy_(weight[part] if by_rows else weight[:, part])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias[part] if by_rows else bias)


def _save(ctx, layer, bias, x, weight) -> None:
    """What a linear layer's backward needs: its ops, whether it has a bias, the input the GEMM
    saw and the weight."""
    ctx.layer, ctx.has_bias = layer, bias is not None
    ctx.save_for_backward(x, weight)


def _weight_and_bias_grads(ctx, grad_y, x):
    """nn.Linear's weight [out, in] and bias [out] gradients from grad_y [T, out] and the input
    x [T, in] the GEMM saw (None where autograd does not need them)."""
    grad_w = grad_y.t() @ x.contiguous() if ctx.needs_input_grad[1] else None
    grad_b = grad_y.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_w, grad_b


# ---- ColumnParallelLinear ------------------------------------------------------------------------
class _ColumnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, layer):
        out, gathered = layer.ag_gemm(_plain(x_shard), _plain(weight), bias=_plain(bias),
                                      return_gathered=True)
        _save(ctx, layer, bias, _torch(gathered), weight)
        return _torch(out)

    @staticmethod
    def backward(ctx, grad_y):
        layer = ctx.layer
        gathered, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:  # reduce-scatter(grad_y [T, out/W] @ W_r [out/W, in])
            grad_x = _torch(layer.gemm_rs(grad_y, _plain(weight)))
        return (grad_x, *_weight_and_bias_grads(ctx, grad_y, gathered), None)


class ColumnParallelLinear(_ParallelLinear):
    """y [T, out/W] = gather_ranks(x_shard) @ W_r^T (+ b_r), the gather hidden in the GEMM.

    Args: world (cuflux.World), in_features, out_features (the full layer's; out_features is
    divided between the ranks: rank r holds rows [r*out/W, (r+1)*out/W) of the full weight),
    max_tokens (the largest T of any call, all ranks' tokens together), bias, dtype (bfloat16
    or float16), timeout_s (of the ops' waits). x_shard: [T/W, in], this rank's tokens.
    """

    SPLIT = "out"

    def _build(self, local_in, local_out):
        self.out_per_rank = local_out
        self.ag_gemm = self._op(cuflux.AllGatherGemm, max_m=self.max_tokens, n=local_out,
                                k=local_in, b_layout="nk")
        # backward: grad_x_shard [T/W, in] = reduce-scatter(grad_y [T, out/W] @ W_r [out/W, in])
        self.gemm_rs = self._op(cuflux.GemmReduceScatter, max_m=self.max_tokens, n=local_in,
                                k=local_out, b_layout="kn")

    def forward(self, x_shard):
        _check_tokens("ColumnParallelLinear", x_shard.shape[0] * self.world.size, self.world,
                      self.max_tokens)
        return _ColumnFn.apply(x_shard, self.weight, self.bias, self)


# ---- RowParallelLinear ---------------------------------------------------------------------------
class _RowFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        out = layer.gemm_rs(_plain(x), _plain(weight), bias=_plain(bias))
        _save(ctx, layer, bias, x, weight)
        return _torch(out)

    @staticmethod
    def backward(ctx, grad_y_shard):
        layer = ctx.layer
        x, weight = ctx.saved_tensors
        grad_y = _torch(layer.all_gather(_plain(grad_y_shard)))
        grad_x = grad_y @ weight if ctx.needs_input_grad[0] else None
        return (grad_x, *_weight_and_bias_grads(ctx, grad_y, x), None)


class RowParallelLinear(_ParallelLinear):
    """y_shard [T/W, out] = rows of this rank of sum_ranks(x @ W_r^T) (+ b), in one kernel.

    Args: world, in_features, out_features (the full layer's; in_features is divided between
    the ranks: rank r holds columns [r*in/W, (r+1)*in/W) of the full weight), max_tokens,
    bias (added once, after the sum), dtype (bfloat16 or float16), timeout_s.
    x: [T, in/W] (e.g. a ColumnParallelLinear's output after an activation).
    """

    SPLIT = "in"

    def _build(self, local_in, local_out):
        self.in_per_rank = local_in
        self.gemm_rs = self._op(cuflux.GemmReduceScatter, max_m=self.max_tokens, n=local_out,
                                k=local_in, b_layout="nk")
        # backward: grad_y [T, out] = all-gather(grad_y_shard [T/W, out])
        self.all_gather = self._op(cuflux.AllGather, max_rows=self.max_tokens // self.world.size,
                                   cols=local_out)

    def forward(self, x):
        _check_tokens("RowParallelLinear", x.shape[0], self.world, self.max_tokens)
        return _RowFn.apply(x, self.weight, self.bias, self)


# ---- ParallelRMSNorm -----------------------------------------------------------------------------
def _rmsnorm_backward(h, weight, eps, grad_out):
    """Local RMSNorm backward in fp32 over the rows of h [n, H]: (grad of h [n, H], the weight
    gradient summed over these n rows [H]). With r = rsqrt(mean(h^2) + eps), n = h * r,
    out = n * w and g = grad_out * w:
      grad_h = r * (g - n * mean(g * n)),   grad_w = sum_rows(grad_out * n)."""
    h32, go = h.float(), grad_out.float()
    r = torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    n = h32 * r
    g = go * weight.float()
    return r * (g - n * (g * n).mean(-1, keepdim=True)), (go * n).sum(0)


class _NormFn(torch.autograd.Function):
    """Gradient conventions (Megatron-LM's): a replicated output's gradient is the loss's full
    gradient, the same on every rank (out in "replicated" and "sharded_residual"); a sharded
    output's gradient is that of this rank's rows (out in "sequence_parallel", the residual
    rows a rank owns). x, each rank's partial sums, gets the full grad_h: h = sum_ranks(x) + ...
    copies grad_h to every x. The weight, replicated, gets its full gradient on every rank."""

    @staticmethod
    def forward(ctx, x, residual, weight, layer):
        new_residual = residual.detach().clone()  # the op updates it in place
        out = layer.op(_plain(x), new_residual, _plain(weight))
        ctx.layer, ctx.num_tokens = layer, x.shape[0]
        ctx.save_for_backward(new_residual, weight)
        return out, new_residual

    @staticmethod
    def backward(ctx, grad_out, grad_res):
        layer, mode = ctx.layer, ctx.layer.output
        new_residual, weight = ctx.saved_tensors
        need_x, need_res, need_w = ctx.needs_input_grad[:3]
        if mode == "replicated":
            # Every rank holds h for all T tokens and the same grads: everything is local, and
            # the weight gradient over all T tokens is already the full one.
            gh, gw = _rmsnorm_backward(new_residual, weight, layer.eps, grad_out)
            gh = (gh + grad_res.float()).to(new_residual.dtype)
            return (gh if need_x else None, gh if need_res else None,
                    gw.to(weight.dtype) if need_w else None, None)
        # sharded_residual / sequence_parallel: this rank holds h only for its token slice
        # [a, b) (the rows it reduced). grad_h of the slice is local; h of the other tokens is
        # on their owners, so:
        #   grad_x [T, H]: the forward reduce-scattered x (sum over ranks, rows to their owner),
        #     its backward all-gathers grad_h's slices (AllGather);
        #   grad_residual: the slice's rows get grad_h (sharded_residual: the other rows of the
        #     residual pass through the op unchanged, so their gradient passes through too);
        #   grad_weight: out depends on the weight through every token, and this rank's sum
        #     covers only its slice; the weight is replicated (each rank holds the same copy
        #     and its optimiser must step on the same full gradient), so the partial sums are
        #     all-reduced (AllReduce, fp32) -- the all-reduce Megatron-LM does for the norms'
        #     weights under sequence parallelism.
        a, b = token_slice(ctx.num_tokens, layer.world.size, layer.world.rank)
        if mode == "sharded_residual":  # out [T, H] replicated, residual [T, H]: take the slice
            h, g_out, g_res = new_residual[a:b], grad_out[a:b], grad_res[a:b]
        else:                           # out, residual: [b - a, H], the slice itself
            h, g_out, g_res = new_residual, grad_out, grad_res
        gh, gw = _rmsnorm_backward(h, weight, layer.eps, g_out)
        gh = (gh + g_res.float()).to(new_residual.dtype)
        grad_x = layer._gather_slices(gh, ctx.num_tokens) if need_x else None
        grad_residual = None
        if need_res:
            if mode == "sharded_residual":
                grad_residual = grad_res.clone()
                grad_residual[a:b] = gh
            else:
                grad_residual = gh
        grad_w = _torch(layer.grad_w_sum(gw.contiguous())).to(weight.dtype) \
            if need_w else None
        return grad_x, grad_residual, grad_w, None


class ParallelRMSNorm(_Layer):
    """Fused all-reduce + residual add + RMSNorm: (out, new_residual) = layer(x, residual),
    h = sum_ranks(x) + residual, out = h * rsqrt(mean(h^2) + eps) * weight, new_residual = h.

    Args: world, hidden, max_tokens, eps, dtype (bfloat16, float16 or float32), output
    (see AllReduceRMSNorm; rank r owns the token slice token_slice(T, W, r), [r*T/W, (r+1)*T/W)
    when W divides T), timeout_s. x: [T, hidden], this rank's partial sums (e.g. a row-parallel
    GEMM's output before its all-reduce). By output:
      "replicated"        residual [T, hidden] -> out [T, hidden], new_residual [T, hidden];
      "sharded_residual"  residual [T, hidden], only the slice's rows read and updated (the
                          others pass through) -> out [T, hidden], new_residual [T, hidden];
      "sequence_parallel" residual [T_r, hidden], the slice -> out, new_residual [T_r, hidden].
    Backward, every mode: grad x [T, hidden] is the full grad of h on every rank; the weight's
    gradient is the full one on every rank (summed over all T tokens: all-reduced where each
    rank holds only its slice). The gradient given for a replicated out must be the same on
    every rank. The sharded modes all-gather grad x (AllGather) and all-reduce the weight
    gradient (AllReduce), ops built here (collective: every rank must ask for the same grads).
    """

    def __init__(self, world, hidden: int, max_tokens: int, eps: float = 1e-6,
                 dtype=torch.bfloat16, output: str = "replicated",
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__(world)
        self.hidden, self.eps, self.output = hidden, eps, output
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=_device(world)))
        self.op = self._own(cuflux.AllReduceRMSNorm(world, max_tokens, hidden, dtype_name(dtype),
                                                    eps=eps, output=output,
                                                    timeout_s=timeout_s))
        if output != "replicated":  # backward of the sharded modes (see _NormFn.backward)
            self.all_gather = self._own(cuflux.AllGather(
                world, max_rows=-(-max_tokens // world.size), cols=hidden,
                dtype=dtype_name(dtype), timeout_s=timeout_s))
            self.grad_w_sum = self._own(cuflux.AllReduce(world, hidden, "float32",
                                                         timeout_s=timeout_s))

    def _gather_slices(self, part, num_tokens: int):
        """Every rank's token slice [T_r, hidden] -> [T, hidden] in token order. Slices differ
        by one row where W does not divide T: each is padded to the largest for the gather."""
        W = self.world.size
        n_max = -(-num_tokens // W)
        if part.shape[0] != n_max:
            part = torch.cat([part, part.new_zeros(n_max - part.shape[0], part.shape[1])])
        gathered = _torch(self.all_gather(part.contiguous()))
        if num_tokens % W == 0:
            return gathered
        rows = [token_slice(num_tokens, W, r) for r in range(W)]
        return torch.cat([gathered[r * n_max:r * n_max + stop - start]
                          for r, (start, stop) in enumerate(rows)])

    def forward(self, x, residual):
        return _NormFn.apply(x, residual, self.weight, self)


# ---- UlyssesAttention ----------------------------------------------------------------------------
class _HeadsFn(torch.autograd.Function):
    """scatter_heads (gather=False) or gather_heads (gather=True); backward: the inverse."""

    @staticmethod
    def forward(ctx, a, op, tokens, gather: bool):
        ctx.op, ctx.tokens, ctx.gather = op, tokens, gather
        run = op.gather_heads if gather else op.scatter_heads
        return run(_plain(a), tokens)

    @staticmethod
    def backward(ctx, grad):
        run = ctx.op.scatter_heads if ctx.gather else ctx.op.gather_heads
        return run(_plain(grad), ctx.tokens), None, None, None


def _sdpa(q, k, v, **kwargs):
    """[B, S, h, D] in and out, through scaled_dot_product_attention's [B, h, S, D]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), **kwargs)
    return out.transpose(1, 2)


class UlyssesAttention(_Layer):
    """Attention over a sequence split between the ranks (Ulysses): q, k, v [B, T_r, H, D] ->
    All2AllHeads scatter -> [B, S, H/W, D] -> attn_fn(q, k, v, **kwargs) -> gather ->
    [B, T_r, H, D]. Backward runs the inverse all-to-alls.

    Args: world, num_heads (H, divisible by W), head_dim, max_tokens_per_rank, batch, dtype
    (bfloat16, float16 or float32), attn_fn (default: scaled_dot_product_attention on
    [B, S, h, D] tensors), timeout_s. forward(q, k, v, tokens_per_rank=None, **attn_kwargs):
    tokens_per_rank defaults to every rank holding q.shape[1] tokens.
    """

    def __init__(self, world, num_heads: int, head_dim: int, max_tokens_per_rank: int,
                 batch: int = 1, dtype=torch.bfloat16, attn_fn=None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__(world)
        self.attn_fn = attn_fn or _sdpa
        self.op = self._own(cuflux.All2AllHeads(world, max_tokens_per_rank, num_heads,
                                                head_dim, dtype_name(dtype), batch=batch,
                                                timeout_s=timeout_s))

    def forward(self, q, k, v, tokens_per_rank=None, **attn_kwargs):
        tokens = tuple(tokens_per_rank) if tokens_per_rank is not None \
            else (q.shape[1],) * self.world.size
        op = self.op
        q, k, v = (_HeadsFn.apply(t, op, tokens, False) for t in (q, k, v))
        out = self.attn_fn(q, k, v, **attn_kwargs)
        return _HeadsFn.apply(out, op, tokens, True)


def dtype_name(dtype) -> str:
    """cuflux's name of a torch dtype ("bfloat16", ...)."""
    return str(dtype).replace("torch.", "")
