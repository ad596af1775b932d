"""What the examples share (not an example itself): the argument parser, the bootstrap under
mpirun or torchrun, timing, relative errors, the report printed by rank 0, and the teardown."""
import argparse

import torch

import cuflux
from cuflux.world import require_device


def parser(doc: str, tokens: int, iters: int = 20, **sizes: int) -> argparse.ArgumentParser:
    """An argument parser whose --help prints the example's docstring (how to launch it), with
    --tokens (T, every rank's tokens together), --iters and one integer option per keyword of
    `sizes` (hidden=4096 gives --hidden, default 4096; kv_heads gives --kv-heads)."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=tokens,
                   help="T, all ranks' tokens together (default %(default)s)")
    p.add_argument("--iters", type=int, default=iters,
                   help="timed iterations (default %(default)s)")
    for name, default in sizes.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                       help="(default %(default)s)")
    return p


def start(num_tokens: int):
    """(world, device): cuflux.init() reads the launcher (mpirun or torchrun) from the
    environment; torch's current device becomes this rank's GPU. Raises NoDeviceError on a
    machine without one; exits when the ranks cannot split num_tokens evenly."""
    require_device("cuflux example")  # without a GPU: NoDeviceError saying why, at once
    world = cuflux.init()
    torch.cuda.set_device(world.device)
    check_divides("--tokens", num_tokens, world.size)
    return world, torch.device("cuda", world.device)


def check_divides(what: str, value: int, world_size: int) -> None:
    if value % world_size:
        raise SystemExit(f"{what}={value} must be divisible by the number of ranks {world_size}")


def time_ms(fn, iters: int) -> float:
    """Mean milliseconds of fn() on torch's current stream, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    for _ in range(iters):
        fn()
    end_ev.record()
    end_ev.synchronize()
    return start_ev.elapsed_time(end_ev) / iters


def times(parallel, single, grad_shard, grad, iters: int) -> dict:
    """{what: (cuflux ms, torch 1 GPU ms)} of the forward and of forward + backward, parallel()
    given this rank's output gradient grad_shard, single() the full one."""
    def fwd_bwd(fn, g):
        return lambda: fn().backward(g)

    return {"forward": (time_ms(parallel, iters), time_ms(single, iters)),
            "forward+backward": (time_ms(fwd_bwd(parallel, grad_shard), iters),
                                 time_ms(fwd_bwd(single, grad), iters))}


def rel_err(got, want) -> float:
    """max |got - want| / max |want|."""
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).abs().max() / want.abs().max())


def report(world, title: str, errs: dict, tol: float, ms: dict) -> bool:
    """Every rank's errors (ok where all < tol) and times {what: (cuflux ms, torch 1 GPU ms)}
    gathered to rank 0 and printed with the speed-up (the slowest rank's time). True on every
    rank when every rank is within tol."""
    me = world.rank
    ok = all(e < tol for e in errs.values())
    shared = any(link.same_gpu and link.peer != me for link in world.topology.links)
    results = world.allgather((errs, ok, ms))
    if me == 0:
        how = "ranks share a GPU: times are not a speed-up" if shared else "one GPU per rank"
        print(f"{title}, W={world.size} ({how})")
        for r, (e, good, _) in enumerate(results):
            print(f"  rank {r}: " + ", ".join(f"{k} rel err {v:.2e}" for k, v in e.items())
                  + (f"  OK (< {tol:g})" if good else f"  MISMATCH (>= {tol:g})"))
        for what in ms:
            par = max(res[2][what][0] for res in results)  # the slowest rank
            one = results[0][2][what][1]
            print(f"  {what:17s} cuflux W={world.size}: {par:8.3f} ms   torch 1 GPU: "
                  f"{one:8.3f} ms   speed-up {one / par:5.2f}x")
    return all(good for _, good, _ in results)


def finish(world, *layers) -> None:
    """Close the layers' ops and the World (collective), then torch.distributed if it was
    started (torchrun)."""
    for layer in layers:
        layer.close()
    world.close()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
