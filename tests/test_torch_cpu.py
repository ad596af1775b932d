"""CPU tests of the PyTorch route (issue 21): cuflux.torch's import refusal, the launcher's
environment and its mismatch refusal (pure functions), torch in / torch out helpers, the
layers' argument checks, and cuflux.init over a torch.distributed gloo group on two CPU
processes (World's host collectives, op communicators, a timeout naming the peer).

Needs torch (skipped, with the reason, where it is missing); no GPU."""
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import cuflux
from cuflux import world as world_mod
from cuflux.arrays import framework_of, is_torch, to_caller
from cuflux.errors import CufluxError

torch = pytest.importorskip("torch", reason="torch is not installed: pip install torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, env=None, timeout=120):
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=e, cwd=ROOT)


# ---- cuflux.torch needs torch ------------------------------------------------------------------
def test_cuflux_torch_without_torch_says_pip_install_torch():
    out = _python("""
        import sys
        sys.modules["torch"] = None  # as if torch were not installed
        import cuflux  # cuflux itself never needs torch
        try:
            import cuflux.torch
        except ImportError as e:
            print("REFUSED:", e)
    """)
    assert "REFUSED: cuflux.torch needs PyTorch" in out.stdout, out.stdout + out.stderr
    assert "pip install torch" in out.stdout


def test_cuflux_torch_imports_and_exports_the_layers():
    import cuflux.torch as ct

    for name in ("ColumnParallelLinear", "RowParallelLinear", "ParallelRMSNorm",
                 "UlyssesAttention"):
        assert issubclass(getattr(ct, name), torch.nn.Module)


# ---- the launcher ------------------------------------------------------------------------------
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1"}
MPIRUN = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
          "OMPI_COMM_WORLD_LOCAL_RANK": "0"}


def test_launcher_from_env_reads_torchrun_and_mpi_launchers():
    t, m = world_mod.launcher_from_env(TORCHRUN)
    assert t == world_mod.Launch("torchrun", 1, 2, 1, "RANK=1, WORLD_SIZE=2") and m is None
    t, m = world_mod.launcher_from_env(MPIRUN)
    assert t is None and (m.launcher, m.rank, m.size, m.local_rank) == ("mpirun", 0, 4, 0)
    t, m = world_mod.launcher_from_env({"PMI_RANK": "3", "PMI_SIZE": "8"})
    assert (m.rank, m.size, m.local_rank) == (3, 8, None)
    assert world_mod.launcher_from_env({}) == (None, None)
    assert world_mod.launcher_from_env({"RANK": "x", "WORLD_SIZE": "2"}) == (None, None)


@pytest.mark.parametrize("env,torch_size,route", [
    (TORCHRUN, None, "torch"),                 # torchrun: torch.distributed from its env
    (MPIRUN, None, "mpi"),                     # mpirun
    ({}, None, "mpi"),                         # no launcher: one process, MPI's singleton
    ({}, 1, "torch"),                          # the caller initialised torch.distributed
    (MPIRUN, 4, "torch"),                      # ... under mpirun, same size: theirs
    (dict(MPIRUN, RANK="0", WORLD_SIZE="4"), None, "mpi"),  # scripts that copy the MPI vars
])
def test_choose_route(env, torch_size, route):
    assert world_mod.choose_route(env, torch_size) == route


@pytest.mark.parametrize("env,torch_size,says", [
    (dict(MPIRUN, RANK="0", WORLD_SIZE="2"), None,
     r"torchrun says 2 \(RANK=0, WORLD_SIZE=2\); mpirun says 4"),
    (TORCHRUN, 1, r"torchrun says 2 .*torch.distributed says 1"),
    (MPIRUN, 2, r"mpirun says 4 .*torch.distributed says 2"),
])
def test_launchers_that_disagree_are_refused(env, torch_size, says):
    with pytest.raises(CufluxError, match="cuflux.init: the launchers disagree on the number "
                                          "of processes: .*" + says):
        world_mod.choose_route(env, torch_size)


def test_init_refuses_torch_objects_that_are_not_process_groups():
    with pytest.raises(TypeError, match=r"comm is a torch object \(torch.Tensor\) but not a "
                                        r"torch.distributed ProcessGroup; comm must be .*"
                                        r"a torch.distributed ProcessGroup"):
        cuflux.init(torch.zeros(1))


# ---- torch in, torch out ------------------------------------------------------------------------
def test_framework_of_is_a_type_test():
    assert framework_of(torch.zeros(2)) == "torch" and is_torch(torch.zeros(2))
    assert framework_of(np.zeros(2)) == "cupy" and not is_torch(np.zeros(2))
    assert not is_torch(None)


def test_to_caller_gives_torch_tensors_sharing_memory():
    out = np.arange(6, dtype=np.float32).reshape(2, 3)
    like = torch.zeros(1)
    t = to_caller(out, like)
    assert isinstance(t, torch.Tensor) and t.shape == (2, 3)
    out[0, 0] = 42  # zero-copy: the tensor sees it
    assert t[0, 0].item() == 42
    assert to_caller(out, np.zeros(1)) is out  # CuPy (or anything else) in: as it is
    given = torch.empty(2, 3)
    assert to_caller(out, like, given) is given  # the caller's own out= comes back
    pair = to_caller((out, None), like, (None, None))
    assert isinstance(pair[0], torch.Tensor) and pair[1] is None
    scale = np.ones(2, np.float32)
    pair = to_caller((out, scale), like, (given, None))
    assert pair[0] is given and isinstance(pair[1], torch.Tensor)


# ---- the layers' argument checks -----------------------------------------------------------------
def test_linear_argument_checks():
    from cuflux.torch import check_linear_args, shard_rows

    assert check_linear_args("L", 2, 64, 128, 256, torch.bfloat16, "out") == (64, 64)
    assert check_linear_args("L", 2, 128, 64, 256, torch.float16, "in") == (64, 64)
    with pytest.raises(ValueError, match="L: out_features=100 must be divisible by the world "
                                         "size 8"):
        check_linear_args("L", 8, 64, 100, 256, torch.bfloat16, "out")
    with pytest.raises(ValueError, match=r"in_features per rank = 12 must be a multiple of 8"):
        check_linear_args("L", 2, 24, 64, 256, torch.bfloat16, "in")
    with pytest.raises(TypeError, match="dtype must be torch.bfloat16 or torch.float16"):
        check_linear_args("L", 2, 64, 64, 256, torch.float32, "out")
    with pytest.raises(ValueError, match="max_tokens=255 must be a multiple of the world size"):
        check_linear_args("L", 2, 64, 64, 255, torch.bfloat16, "out")
    with pytest.raises(ValueError, match="in_features must be an int >= 1, got 64.0"):
        check_linear_args("L", 2, 64.0, 64, 256, torch.bfloat16, "out")
    assert shard_rows(12, 3, 1) == slice(4, 8)


def test_layers_check_arguments_before_building_ops():
    """A stand-in world (no GPU, no ranks): the checks raise before any op is built."""
    from types import SimpleNamespace

    from cuflux.torch import ColumnParallelLinear, RowParallelLinear

    world = SimpleNamespace(size=4, rank=0, device=None)
    with pytest.raises(ValueError, match="ColumnParallelLinear: out_features=66 must be "
                                         "divisible by the world size 4"):
        ColumnParallelLinear(world, 64, 66, 256)
    with pytest.raises(ValueError, match="RowParallelLinear: in_features per rank = 4"):
        RowParallelLinear(world, 16, 64, 256)


# ---- ParallelRMSNorm's backward: the local math and the gather of uneven slices ---------------
def test_rmsnorm_backward_closed_form_matches_autograd():
    from cuflux.torch import _rmsnorm_backward

    g = torch.Generator().manual_seed(3)
    h, go = (torch.randn(7, 40, generator=g, dtype=torch.float64) for _ in range(2))
    w = 1 + 0.3 * torch.randn(40, generator=g, dtype=torch.float64)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = hr * torch.rsqrt(hr.pow(2).mean(-1, keepdim=True) + 1e-6) * wr
    want_h, want_w = torch.autograd.grad(out, (hr, wr), go)
    gh, gw = _rmsnorm_backward(h, w, 1e-6, go)  # fp32 inside
    assert torch.allclose(gh.double(), want_h, rtol=1e-4, atol=1e-5)
    assert torch.allclose(gw.double(), want_w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T,W", [(12, 4), (13, 4), (3, 4), (7, 2), (5, 1)])
def test_norm_gathers_every_ranks_token_slice_in_token_order(T, W, monkeypatch):
    """_gather_slices pads this rank's slice to the largest for AllGather (equal rows per rank)
    and drops every rank's padding: token t lands at row t. A stand-in AllGather returns what
    the W ranks would pass, padding rows set to -1."""
    from types import SimpleNamespace

    import cuflux.torch as ct
    from cuflux.ops.allreduce import token_slice

    monkeypatch.setattr(ct, "_stream", lambda: None)
    n_max = -(-T // W)
    tokens = torch.arange(T, dtype=torch.float32)[:, None].expand(T, 3)
    for me in range(W):
        def all_gather(part, stream=None):
            padded = [torch.full((n_max, 3), -1.0) for _ in range(W)]
            for r in range(W):
                a, b = token_slice(T, W, r)
                padded[r][:b - a] = tokens[a:b]
            a, b = token_slice(T, W, me)
            assert part.shape == (n_max, 3) and torch.equal(part[:b - a], tokens[a:b])
            return torch.cat(padded)

        layer = SimpleNamespace(world=SimpleNamespace(size=W, rank=me), all_gather=all_gather)
        a, b = token_slice(T, W, me)
        got = ct.ParallelRMSNorm._gather_slices(layer, tokens[a:b], T)
        assert torch.equal(got, tokens), (me, got[:, 0])


# ---- cuflux.init on a torch.distributed group: two CPU processes over gloo ----------------------
_RANK_BODY = """
    import os, sys, time
    import torch.distributed as dist
    import cuflux
    from cuflux.errors import CommTimeoutError
    rank = int(os.environ["RANK"])
    if os.environ["HOW"] == "group":
        dist.init_process_group("gloo", init_method=os.environ["INIT"], rank=rank, world_size=2)
        world = cuflux.init(dist.group.WORLD, timeout_s=20)
    else:  # torchrun's variables: init reads them
        world = cuflux.init(timeout_s=20)
    assert "mpi4py.MPI" not in sys.modules, "the torch route imported mpi4py"
    assert (world.rank, world.size, world.device) == (rank, 2, None), world
    assert world.allgather(rank * 10) == [0, 10]
    world.check_same(("same", 1), "arguments")
    try:
        world.check_same(rank, "rank")
        raise AssertionError("check_same passed different values")
    except ValueError as e:
        assert "rank 0: 0, rank 1: 1" in str(e)
    oc = world.sub_comm("AllReduce")
    assert oc.op_id == "AllReduce#0" and oc.allgather("x") == ["x", "x"]
    assert oc.exchange_digest(2**64 - 1 - rank, 10.0) == [2**64 - 1, 2**64 - 2]
    oc.close()
    if rank == 1:
        time.sleep(4)  # never comes to the barrier
        print("RANK1-DONE")
    else:
        t = time.monotonic()
        try:
            world.barrier(timeout_s=1.5)
        except CommTimeoutError as e:
            print(f"TIMEOUT op={e.op!r} rank={e.rank} peer={e.peer} after "
                  f"{time.monotonic() - t:.1f}")
    world.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["group", "torchrun_env"])
def test_init_on_torch_distributed_gloo_two_processes(how):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HOW=how, INIT=f"tcp://127.0.0.1:{port}", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE="2")
    for k in [k for k in env if k.startswith(("OMPI_", "PMI_", "PMIX_"))]:
        del env[k]
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_RANK_BODY)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\nKILLED")
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(outs)
    assert "TIMEOUT op='World World.barrier' rank=0 peer=1" in outs[0], outs[0]
    seconds = float(outs[0].split("after ")[1].split()[0])
    assert 1.0 <= seconds < 10, outs[0]
    assert "RANK1-DONE" in outs[1]
