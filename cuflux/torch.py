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
                        and the new residual (AllReduceRMSNorm; backward: output="replicated")
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
from cuflux.ops.base import DEFAULT_TIMEOUT_S

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelRMSNorm", "UlyssesAttention",
           "check_linear_args", "shard_rows"]

_GEMM_DTYPES = (torch.bfloat16, torch.float16)


def _stream():
    return torch.cuda.current_stream()


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
        self._build(dtype_name(dtype), local_in, local_out, timeout_s)

    def _build(self, dtype: str, local_in: int, local_out: int, timeout_s: float) -> None:
        raise NotImplementedError


# ---- ColumnParallelLinear ------------------------------------------------------------------------
class _ColumnFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_shard, weight, bias, layer):
        out, gathered = layer.ag_gemm(_plain(x_shard), _plain(weight), bias=_plain(bias),
                                      return_gathered=True, stream=_stream())
        ctx.layer = layer
        ctx.has_bias = bias is not None
        gathered = _torch(gathered)
        ctx.save_for_backward(gathered, weight)
        return _torch(out)

    @staticmethod
    def backward(ctx, grad_y):
        layer = ctx.layer
        gathered, weight = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # reduce-scatter(grad_y [T, out/W] @ W_r [out/W, in])
            grad_x = _torch(layer.gemm_rs(grad_y, _plain(weight), stream=_stream()))
        if ctx.needs_input_grad[1]:
            grad_w = grad_y.t() @ gathered
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_y.sum(0)
        return grad_x, grad_w, grad_b, None


class ColumnParallelLinear(_ParallelLinear):
    """y [T, out/W] = gather_ranks(x_shard) @ W_r^T (+ b_r), the gather hidden in the GEMM.

    Args: world (cuflux.World), in_features, out_features (the full layer's; out_features is
    divided between the ranks: rank r holds rows [r*out/W, (r+1)*out/W) of the full weight),
    max_tokens (the largest T of any call, all ranks' tokens together), bias, dtype (bfloat16
    or float16), timeout_s (of the ops' waits). x_shard: [T/W, in], this rank's tokens.
    """

    SPLIT = "out"

    def _build(self, dtype, local_in, local_out, timeout_s):
        world, max_tokens = self.world, self.max_tokens
        self.out_per_rank = local_out
        self.ag_gemm = self._own(cuflux.AllGatherGemm(
            world, max_m=max_tokens, n=local_out, k=local_in, dtype=dtype, b_layout="nk",
            timeout_s=timeout_s))
        # backward: grad_x_shard [T/W, in] = reduce-scatter(grad_y [T, out/W] @ W_r [out/W, in])
        self.gemm_rs = self._own(cuflux.GemmReduceScatter(
            world, max_m=max_tokens, n=local_in, k=local_out, dtype=dtype, b_layout="kn",
            timeout_s=timeout_s))

    @torch.no_grad()
    def load_full(self, weight, bias=None) -> None:
        """Take this rank's shard of the full layer's weight [out, in] (and bias [out])."""
        rows = shard_rows(self.out_features, self.world.size, self.world.rank)
        self.weight.copy_(weight[rows])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias[rows])

    def forward(self, x_shard):
        _check_tokens("ColumnParallelLinear", x_shard.shape[0] * self.world.size, self.world,
                      self.max_tokens)
        return _ColumnFn.apply(x_shard, self.weight, self.bias, self)


# ---- RowParallelLinear ---------------------------------------------------------------------------
class _RowFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        out = layer.gemm_rs(_plain(x), _plain(weight), bias=_plain(bias), stream=_stream())
        ctx.layer = layer
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return _torch(out)

    @staticmethod
    def backward(ctx, grad_y_shard):
        layer = ctx.layer
        x, weight = ctx.saved_tensors
        grad_y = _torch(layer.all_gather(_plain(grad_y_shard), stream=_stream()))
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_y @ weight
        if ctx.needs_input_grad[1]:
            grad_w = grad_y.t() @ x.contiguous()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_y.sum(0)
        return grad_x, grad_w, grad_b, None


class RowParallelLinear(_ParallelLinear):
    """y_shard [T/W, out] = rows of this rank of sum_ranks(x @ W_r^T) (+ b), in one kernel.

    Args: world, in_features, out_features (the full layer's; in_features is divided between
    the ranks: rank r holds columns [r*in/W, (r+1)*in/W) of the full weight), max_tokens,
    bias (added once, after the sum), dtype (bfloat16 or float16), timeout_s.
    x: [T, in/W] (e.g. a ColumnParallelLinear's output after an activation).
    """

    SPLIT = "in"

    def _build(self, dtype, local_in, local_out, timeout_s):
        world, max_tokens = self.world, self.max_tokens
        self.in_per_rank = local_in
        self.gemm_rs = self._own(cuflux.GemmReduceScatter(
            world, max_m=max_tokens, n=local_out, k=local_in, dtype=dtype, b_layout="nk",
            timeout_s=timeout_s))
        self.all_gather = self._own(cuflux.AllGather(
            world, max_rows=max_tokens // world.size, cols=local_out, dtype=dtype,
            timeout_s=timeout_s))

    @torch.no_grad()
    def load_full(self, weight, bias=None) -> None:
        """Take this rank's shard of the full layer's weight [out, in] (and its bias [out])."""
        cols = shard_rows(self.in_features, self.world.size, self.world.rank)
        self.weight.copy_(weight[:, cols])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    def forward(self, x):
        _check_tokens("RowParallelLinear", x.shape[0], self.world, self.max_tokens)
        return _RowFn.apply(x, self.weight, self.bias, self)


# ---- ParallelRMSNorm -----------------------------------------------------------------------------
def _rmsnorm_backward(h, weight, eps, grad_out, grad_h_extra):
    """Local RMSNorm backward in fp32: (grad of h, grad of weight)."""
    with torch.enable_grad():
        h32 = h.detach().float().requires_grad_()
        w32 = weight.detach().float().requires_grad_()
        y = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * w32
        gh, gw = torch.autograd.grad(y, (h32, w32), grad_out.float())
    if grad_h_extra is not None:
        gh = gh + grad_h_extra.float()
    return gh, gw


class _NormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, layer):
        new_residual = residual.detach().clone()  # the op updates it in place
        out = layer.op(_plain(x), new_residual, _plain(weight), stream=_stream())
        ctx.layer = layer
        ctx.save_for_backward(new_residual, weight)
        return out, new_residual

    @staticmethod
    def backward(ctx, grad_out, grad_res):
        layer = ctx.layer
        if layer.output != "replicated":
            raise NotImplementedError(
                f"ParallelRMSNorm: backward is implemented for output='replicated' only, this "
                f"layer has output={layer.output!r}")
        h, weight = ctx.saved_tensors
        gh, gw = _rmsnorm_backward(h, weight, layer.eps, grad_out, grad_res)
        gh = gh.to(h.dtype)
        # replicated: every rank holds h = sum_ranks(x) + residual and the same grad; the
        # gradient of each rank's partial x is grad_h (no communication).
        return gh, gh, gw.to(weight.dtype), None


class ParallelRMSNorm(_Layer):
    """Fused all-reduce + residual add + RMSNorm: (out, new_residual) = layer(x, residual),
    h = sum_ranks(x) + residual, out = h * rsqrt(mean(h^2) + eps) * weight, new_residual = h.

    Args: world, hidden, max_tokens, eps, dtype (bfloat16, float16 or float32), output
    ("replicated", "sharded_residual" or "sequence_parallel": see AllReduceRMSNorm; backward is
    implemented for "replicated"), timeout_s. x: [T, hidden], this rank's partial sums (e.g. a
    row-parallel GEMM's output before its all-reduce); residual as AllReduceRMSNorm takes it.
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

    def forward(self, x, residual):
        return _NormFn.apply(x, residual, self.weight, self)


# ---- UlyssesAttention ----------------------------------------------------------------------------
class _HeadsFn(torch.autograd.Function):
    """scatter_heads (gather=False) or gather_heads (gather=True); backward: the inverse."""

    @staticmethod
    def forward(ctx, a, op, tokens, gather: bool):
        ctx.op, ctx.tokens, ctx.gather = op, tokens, gather
        run = op.gather_heads if gather else op.scatter_heads
        return run(_plain(a), tokens, stream=_stream())

    @staticmethod
    def backward(ctx, grad):
        run = ctx.op.scatter_heads if ctx.gather else ctx.op.gather_heads
        return run(_plain(grad), ctx.tokens, stream=_stream()), None, None, None


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
