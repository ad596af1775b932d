"""World: rank, size, device and topology of an mpi4py communicator (a TP group).

Host collectives are bounded. `barrier`, `allgather` and `check_same` are nonblocking exchanges
(one pickled message to every peer, `isend`, matched with `improbe`) polled against a deadline;
when it passes they raise `CommTimeoutError` naming the first peer that never arrived. Every
message carries the collective's sequence number and name, so ranks that call different
collectives (ops built or closed in different orders) get a clear error rather than pairing
the wrong ones. After a failed collective the group is out of step and refuses further ones.
The World runs them on its own duplicate of the caller's communicator, so cuflux's messages
never meet the caller's.

Each op takes its own duplicate through `World.sub_comm(tag)` (an `OpComm`, checked across
ranks when it is made and when it is closed): ops built or closed in different orders on
different ranks raise instead of waiting in each other's barriers.

GPU choice (`choose_device`): `device=` when given; otherwise the process's node-local rank
(from the launcher's environment, else computed over a communicator that spans COMM_WORLD)
modulo the device count. A World built on a sub-communicator lands on the GPU a World on
COMM_WORLD would pick. The World never changes the caller's current device: ops enter
`world.device_context()` (`with cupy.cuda.Device(world.device)`) where they need it.

`device_count()` is 0 only when the machine has no GPU (no NVIDIA driver, or CUDA sees no
device); a CUDA set-up that cannot work (CuPy missing, a driver older than the CUDA extra
installed) raises `CudaSetupError` saying what to install.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import pickle
import secrets
import socket
import sys
import time
from typing import Any, Mapping, NamedTuple

import numpy as np

from cuflux import knobs
from cuflux.errors import CommTimeoutError, CufluxError
from cuflux.topology import PeerLink, Topology

__all__ = ["World", "OpComm", "HostGroup", "TorchGroup", "TorchOpComm", "init", "launcher_from_env",
           "choose_route", "Launch", "device_count", "require_device",
           "choose_device", "local_rank_from_env", "classify_device_error", "CudaSetupError",
           "NoDeviceError", "DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "LOCAL_RANK_ENV",
           "ranks_on_my_gpu"]

# Bound of every host collective (set-up, barriers, close), unless World(timeout_s=...) or the
# call says otherwise. Long enough for a peer that compiles kernels on first use (up to ~40 s a
# file, several files for some ops) to be late rather than reported dead; finite, so a dead
# peer costs at most this long.
DEFAULT_TIMEOUT_S = knobs.HOST_TIMEOUT_S.default
TIMEOUT_ENV = knobs.HOST_TIMEOUT_S.name  # overrides DEFAULT_TIMEOUT_S for every World (knobs)

# The launcher's node-local rank, most specific first. MPI launchers before the generic names:
# mpiexec under Slurm runs its proxies through srun, so SLURM_LOCALID of an MPI rank is the
# proxy's (0 for every rank of the node).
LOCAL_RANK_ENV = ("OMPI_COMM_WORLD_LOCAL_RANK",  # Open MPI
                  "MPI_LOCALRANKID",             # MPICH (Hydra), Intel MPI
                  "MV2_COMM_WORLD_LOCAL_RANK",   # MVAPICH
                  "PALS_LOCAL_RANKID",           # HPE PALS
                  "LOCAL_RANK",                  # torchrun and most launch scripts
                  "SLURM_LOCALID")               # srun

_TAG = 0x6378  # point-to-point tag of cuflux's host collectives (on communicators it owns)
_DIGEST_TAG = 7301  # tag of exchange_digest (All2AllHeads' per-call argument check)
_NODE_LOCAL_RANK: int | None = None  # this process's node-local rank in COMM_WORLD, once known


# Defined in cuflux.errors with every other error; named here too, where they are raised.
from cuflux.errors import CudaSetupError, NoDeviceError  # noqa: E402


def check_timeout(what: str, timeout_s) -> float:
    """A finite number of seconds > 0 (nan and inf would make a wait unbounded)."""
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float, np.floating))
            or not math.isfinite(timeout_s) or timeout_s <= 0):
        raise ValueError(f"{what}: timeout_s must be a finite number of seconds > 0, "
                         f"got {timeout_s!r}")
    return float(timeout_s)


def default_timeout_s() -> float:
    return knobs.host_timeout_s()


# ---- how many GPUs, and which one ----------------------------------------------------------
_CUDA_ERROR_INSUFFICIENT_DRIVER = 35
_CUDA_ERROR_NO_DEVICE = 100
_HOW_TO_INSTALL = ('pip install "cuflux[cuda13]" for NVIDIA drivers >= 580 (CUDA 13), '
                   '"cuflux[cuda12]" for drivers >= 525 (CUDA 12)')


def _cuda_version(v: int | None) -> str:
    return "unknown" if not v else f"{v // 1000}.{v % 1000 // 10}"


def classify_device_error(status: int, *, driver_present: bool, driver_version: int | None = None,
                          runtime_version: int | None = None, message: str = "") -> int:
    """What a failed cudaGetDeviceCount means: 0 (no GPU here) or a CudaSetupError.

    status: the cudaError_t; driver_present: libcuda can be loaded; driver_version: what
    cuDriverGetVersion says (CUDA version x 1000, as 12040); runtime_version: the CUDA runtime
    CuPy uses (same encoding). No GPU means: cudaErrorNoDevice (none visible, or
    CUDA_VISIBLE_DEVICES hides them all), or no driver library at all (the CUDA runtime then
    reports cudaErrorInsufficientDriver, the same code as a driver that is too old).
    """
    if status == _CUDA_ERROR_NO_DEVICE:
        return 0
    if status == _CUDA_ERROR_INSUFFICIENT_DRIVER and not driver_present:
        return 0
    if status == _CUDA_ERROR_INSUFFICIENT_DRIVER:
        drv, rt = _cuda_version(driver_version), _cuda_version(runtime_version)
        if driver_version and driver_version >= 13000:
            fix = ("update the NVIDIA driver to one that supports CUDA " + rt)
        elif driver_version and driver_version >= 12000:
            fix = ('install the CUDA 12 build instead: pip uninstall cupy-cuda13x && '
                   'pip install "cuflux[cuda12]" (or update the driver to >= 580)')
        else:
            fix = "update the NVIDIA driver (>= 525 for cuflux[cuda12], >= 580 for cuflux[cuda13])"
        raise CudaSetupError(
            f"device_count: the NVIDIA driver supports CUDA {drv} but CuPy was built for CUDA "
            f"{rt} (cudaErrorInsufficientDriver): {fix}")
    raise CudaSetupError(
        f"device_count: CUDA could not start (error {status}{': ' + message if message else ''}); "
        "check that the NVIDIA driver is loaded (nvidia-smi) and matches the CUDA extra: "
        + _HOW_TO_INSTALL)


def _driver_probe() -> tuple[bool, int | None]:
    """(libcuda can be loaded, the CUDA version it supports), without initialising CUDA."""
    names = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        try:
            if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
                return True, None
        except AttributeError:
            return True, None
        return True, version.value
    return False, None


def _device_count_and_reason() -> tuple[int, str]:
    try:
        from cupy.cuda import runtime
    except ImportError as e:
        raise CudaSetupError(f"cuflux needs CuPy, which cannot be imported ({e}): "
                             + _HOW_TO_INSTALL) from e
    except Exception as e:  # CuPy present but its CUDA libraries are not
        raise CudaSetupError(f"CuPy cannot start ({type(e).__name__}: {e}): "
                             + _HOW_TO_INSTALL) from e
    try:
        n = runtime.getDeviceCount()
    except runtime.CUDARuntimeError as e:
        present, drv = _driver_probe()
        try:
            rt = runtime.runtimeGetVersion()
        except Exception:
            rt = None
        n = classify_device_error(int(e.status), driver_present=present, driver_version=drv,
                                  runtime_version=rt, message=str(e))
        if not present:
            return n, "no NVIDIA driver is installed on this machine"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return n, ("CUDA sees no device" + (f" (CUDA_VISIBLE_DEVICES={visible!r})"
                                            if visible is not None else ""))
    return n, "" if n else "CUDA sees no device"


def device_count() -> int:
    """Number of visible CUDA devices: 0 only when this machine has none (no NVIDIA driver, or
    CUDA sees no device). A CUDA installation that cannot work raises CudaSetupError."""
    return _device_count_and_reason()[0]


def require_device(op: str) -> int:
    """The number of visible devices (>= 1), or NoDeviceError "{op}: needs a CUDA device; ..."
    (ops call it first, so every op says the same thing on a machine without a GPU)."""
    n, why = _device_count_and_reason()
    if n == 0:
        raise NoDeviceError(f"{op}: needs a CUDA device; {why}")
    return n


def local_rank_from_env(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(variable, node-local rank) from the first of LOCAL_RANK_ENV that holds an integer."""
    for name in LOCAL_RANK_ENV:
        value = env.get(name, "").strip()
        if value.isdigit():
            return name, int(value)
    return None


def choose_device(num_devices: int, device: int | None = None, env_local_rank: int | None = None,
                  node_local_rank: int | None = None, *, what: str = "World") -> int | None:
    """The GPU a rank uses: `device` when given, else (node-local rank % num_devices), the
    node-local rank from the launcher (env_local_rank) or from COMM_WORLD (node_local_rank).
    None when the machine has no GPU. Raises when the rank cannot be known."""
    if device is not None:
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"{what}: device must be an int, got {type(device).__name__}")
        if num_devices == 0:
            raise NoDeviceError(f"{what}: device={device} was given but this machine has no "
                                "CUDA device")
        if not 0 <= device < num_devices:
            raise ValueError(f"{what}: device={device} is not one of the {num_devices} visible "
                             "devices")
        return device
    if num_devices == 0:
        return None
    local = env_local_rank if env_local_rank is not None else node_local_rank
    if local is None:
        raise CufluxError(
            f"{what}: cannot tell which GPU this process should use: the communicator does not "
            f"span COMM_WORLD and the launcher set none of {', '.join(LOCAL_RANK_ENV)}; pass "
            "device= (for example torch.cuda.current_device())")
    return local % num_devices


def _current_device() -> int | None:
    try:
        from cupy.cuda import runtime

        return runtime.getDevice()
    except Exception:
        return None


# ---- bounded host collectives --------------------------------------------------------------
class HostGroup:
    """Bounded host collectives over one communicator.

    allgather/barrier/check_same raise CommTimeoutError(op, rank, first missing peer, seconds)
    when a peer does not arrive within the timeout, and CufluxError when peers are at another
    collective. Either failure leaves the group out of step: later calls raise at once.

    Every message carries group_id, an id the ranks agreed on: a message left over from a
    freed group (a peer that gave up, a rank that never came) can sit in MPI's queue and match
    a later communicator that reuses the freed one's context id; it is recognised and dropped.
    """

    def __init__(self, comm, timeout_s: float, label: str, group_id: str = ""):
        self.comm, self.label, self.group_id = comm, label, group_id
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.timeout_s = check_timeout(label, timeout_s)
        self._seq = 0
        self._sends: list = []  # isend requests still in flight (their buffers must live)
        self._failure: BaseException | None = None

    def _check_usable(self, what: str) -> None:
        if self._failure is not None:
            raise CufluxError(f"{self.label}: cannot run {what}: an earlier host collective "
                              f"failed ({self._failure}); the ranks are out of step, build a "
                              "new World or op")
        if self.comm is None:
            raise CufluxError(f"{self.label}: cannot run {what}: the communicator is freed")

    def allgather(self, obj: Any, timeout_s: float | None = None, what: str = "allgather") -> list:
        """Every rank's obj, in rank order (objects are pickled)."""
        self._check_usable(what)
        timeout_s = self.timeout_s if timeout_s is None else check_timeout(what, timeout_s)
        seq, self._seq = self._seq, self._seq + 1
        me, W = self.rank, self.size
        if W == 1:
            return [obj]
        self._sends = [r for r in self._sends if not r.Test()]
        sending = {}  # peer -> this call's isend to it, until it completes
        for p in range(W):
            if p != me:
                sending[p] = self.comm.isend((self.group_id, seq, what, obj), dest=p, tag=_TAG)
        self._sends.extend(sending.values())
        got: dict[int, Any] = {me: obj}
        pending = [(me + i) % W for i in range(1, W)]  # the next rank first: "first missing"
        receiving: dict[int, Any] = {}  # peer -> nonblocking receive of its matched message
        deadline = time.monotonic() + timeout_s
        polls = 0
        while True:
            for p in list(pending):
                while True:
                    if p not in receiving:
                        msg = self.comm.improbe(source=p, tag=_TAG)
                        if msg is None:
                            break
                        # Nonblocking: a large message moves only while its sender makes MPI
                        # calls; a blocking receive could wait, unbounded, on a sender that left.
                        receiving[p] = msg.irecv()
                    done, data = receiving[p].test()
                    if not done:
                        break
                    del receiving[p]
                    gid, their_seq, their_what, their_obj = data
                    if gid != self.group_id:
                        continue  # left over from a freed group: not ours
                    if (their_seq, their_what) != (seq, what):
                        self._failure = CufluxError(
                            f"{self.label}: rank {me} is at host collective #{seq} ({what!r}) "
                            f"while rank {p} is at #{their_seq} ({their_what!r}): the ranks "
                            "called cuflux's collectives in different orders")
                        raise self._failure
                    got[p] = their_obj
                    pending.remove(p)
                    break
            # Return only once our own messages are delivered too: a rank that left with a
            # large send in flight (it moves only while this rank makes MPI calls) and then
            # blocked in CUDA would leave a peer waiting inside this collective for its data.
            for p in [p for p, r in sending.items() if r.Test()]:
                del sending[p]
            if not pending and not sending:
                return [got[r] for r in range(W)]
            if time.monotonic() > deadline:
                self._sends.extend(receiving.values())  # in flight: their buffers must live
                if pending:
                    detail = f"ranks {sorted(pending)} did not arrive"
                else:
                    detail = f"ranks {sorted(sending)} did not take this rank's message"
                self._failure = CommTimeoutError(f"{self.label} {what}", me,
                                                 (pending or sorted(sending))[0], timeout_s,
                                                 detail)
                raise self._failure
            polls += 1
            # Spin briefly (a barrier of ranks that are all there takes microseconds), then
            # sleep so a waiting rank does not take a core from the one it waits for.
            if polls > 200:
                time.sleep(min(0.002, 1e-5 * (polls - 200)))

    def barrier(self, timeout_s: float | None = None, what: str = "barrier") -> None:
        self.allgather(None, timeout_s, what)

    def check_same(self, value: Any, what: str, timeout_s: float | None = None) -> None:
        """Raise ValueError on every rank if `value` differs between ranks (compares a hash)."""
        _check_same(lambda o, label: self.allgather(o, timeout_s, label), value, what)

    def exchange_digest(self, digest: int, timeout_s: float,
                        what: str = "exchange_digest") -> list[int]:
        """Every rank's 64-bit digest, in rank order: nonblocking point-to-point messages on
        their own tag, polled against the deadline. On expiry the receives are cancelled and
        CommTimeoutError names the lowest rank that did not send; the group stays usable (the
        caller decides what the failure means)."""
        from mpi4py import MPI

        W, me, comm = self.size, self.rank, self.comm
        mine = np.array([digest], dtype=np.uint64)
        theirs = np.zeros(W, dtype=np.uint64)
        theirs[me] = mine[0]
        peers = [p for p in range(W) if p != me]
        sends = [comm.Isend(mine, dest=p, tag=_DIGEST_TAG) for p in peers]
        recvs = {p: comm.Irecv(theirs[p:p + 1], source=p, tag=_DIGEST_TAG) for p in peers}
        deadline = time.monotonic() + timeout_s
        while recvs:
            for p in [p for p, r in recvs.items() if r.Test()]:
                del recvs[p]
            if recvs and time.monotonic() > deadline:
                for r in recvs.values():
                    r.Cancel()
                MPI.Request.Waitall(list(recvs.values()))
                raise CommTimeoutError(f"{self.label} {what}", me, min(recvs), timeout_s,
                                       f"ranks {sorted(recvs)} did not send")
        MPI.Request.Waitall(sends)  # 8-byte messages: sent eagerly, every peer received ours
        return [int(v) for v in theirs]

    def dup(self, what: str = "dup", timeout_s: float | None = None):
        """A duplicate of the communicator (MPI_Comm_idup, polled against the deadline)."""
        self._check_usable(what)
        timeout_s = self.timeout_s if timeout_s is None else check_timeout(what, timeout_s)
        newcomm, req = self.comm.Idup()
        deadline = time.monotonic() + timeout_s
        polls = 0
        while not req.Test():
            if time.monotonic() > deadline:
                self._failure = CommTimeoutError(f"{self.label} {what}", self.rank, -1,
                                                 timeout_s, "duplicating the communicator")
                raise self._failure
            polls += 1
            if polls > 200:
                time.sleep(0.001)
        return newcomm

    def free(self) -> None:
        """Free the communicator (local: no collective). Messages that arrived for it and were
        never received are drained first (the group ids of later groups guard the rest)."""
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                while (msg := comm.improbe(tag=_TAG)) is not None:
                    req = msg.irecv()  # bounded: a large message of a rank gone never completes
                    give_up = time.monotonic() + 1.0
                    while not req.Test() and time.monotonic() < give_up:
                        time.sleep(0.001)
                    if time.monotonic() >= give_up:
                        self._sends.append(req)  # its buffer must live
                        break
            except Exception:
                pass
            _free_comm(comm)


def _check_same(allgather, value: Any, what: str) -> None:
    digest = hashlib.sha1(pickle.dumps(value)).hexdigest()
    digests = allgather(digest, f"check_same({what})")
    if len(set(digests)) > 1:
        values = allgather(value, f"check_same({what}) values")
        raise ValueError(f"{what} differs between ranks: "
                         + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values)))


def _free_comm(comm) -> None:
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized() and comm != MPI.COMM_NULL:
            comm.Free()
    except Exception:
        pass  # freeing is best effort: a leaked communicator costs one context id


class OpComm(HostGroup):
    """An op's own communicator (World.sub_comm): bounded collectives, an id agreed by every
    rank, a close that checks every rank closes the same op.

    An op uses it for every host collective of its own (its SymmetricBuffer included:
    `world.alloc_layout(layout, group=self.comm)`) and, in `_release`:
      normal close:  self.comm.check_close(); self.buf.close(); self.comm.free()
      abort:         self.buf.close(abort=True, streams=...); self.comm.free()
    """

    def __init__(self, comm, timeout_s: float, op_id: str, parent: HostGroup):
        super().__init__(comm, timeout_s, op_id, f"{parent.group_id}/{op_id}")
        self.op_id, self._parent = op_id, parent

    def check_close(self, timeout_s: float | None = None) -> None:
        """Collective over the World (bounded): every rank is closing this op now. Raises
        CufluxError naming what each rank closes when they disagree."""
        ids = self._parent.allgather(self.op_id, timeout_s, "close op")
        if len(set(ids)) > 1:
            raise CufluxError(f"{self.op_id}: ops closed in different orders: "
                              + ", ".join(f"rank {r} closes {i}" for r, i in enumerate(ids)))

    def close(self, timeout_s: float | None = None) -> None:
        try:
            self.check_close(timeout_s)
        finally:
            self.free()


# ---- host collectives over torch.distributed ---------------------------------------------------
def is_torch_group(comm) -> bool:
    """comm is a torch.distributed ProcessGroup (a type test; torch is never imported here: an
    object of torch's can only exist once the caller imported it)."""
    if "torch" not in sys.modules or comm is None:
        return False
    try:
        import torch.distributed as dist

        return dist.is_available() and isinstance(comm, dist.ProcessGroup)
    except Exception:
        return False


def _peer_named(message: str, group_ranks: list[int], me: int) -> int:
    """The group rank a torch / gloo error names ("rank 3", "Rank 3", global ranks), else the
    other rank of a pair, else -1: gloo's own timeouts say which operation expired, not which
    peer."""
    import re

    for m in re.finditer(r"\b[Rr]anks? \[?(\d+)", message):
        r = int(m.group(1))
        if r in group_ranks and group_ranks.index(r) != me:
            return group_ranks.index(r)
    return 1 - me if len(group_ranks) == 2 else -1  # of two ranks, the other one


def _new_gloo_group(ranks: list[int], timeout_s: float, label: str, what: str, me: int):
    """A gloo group of cuflux's own over `ranks` (global ranks), made by those ranks only
    (use_local_synchronization: the caller's group may be a subgroup), its collectives bounded
    by timeout_s (gloo's own deadline, set at creation)."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        return dist.new_group(ranks=ranks, timeout=timedelta(seconds=timeout_s), backend="gloo",
                              use_local_synchronization=True)
    except Exception as e:
        raise CommTimeoutError(f"{label} {what}", me, _peer_named(str(e), ranks, me), timeout_s,
                               f"torch.distributed could not make cuflux's gloo group: "
                               f"{type(e).__name__}: {str(e)[:300]}") from e


class TorchGroup(HostGroup):
    """HostGroup's interface (allgather, barrier, check_same, exchange_digest, dup, free) over
    a torch.distributed gloo group of cuflux's own, so World and the ops run unchanged on the
    torch route (no mpi4py).

    `comm` is the gloo ProcessGroup. Its collectives are bounded by gloo's timeout, set when
    the group is made (timeout_s; a call with another timeout sets the group's for that call
    where torch allows it). On expiry, or when a peer's process is gone, CommTimeoutError names
    the op, this rank and the peer where torch's message says which (-1 where it does not:
    gloo reports which operation expired, not who was missing). Messages carry (group id,
    sequence number, name) as HostGroup's do: peers at another collective raise CufluxError.
    """

    def __init__(self, comm, timeout_s: float, label: str, group_id: str = "",
                 owned: bool = True):
        import torch.distributed as dist

        self.comm, self.label, self.group_id = comm, label, group_id
        self.rank: int = dist.get_rank(comm)
        self.size: int = dist.get_world_size(comm)
        self.ranks: list[int] = dist.get_process_group_ranks(comm)  # global ranks
        self.timeout_s = check_timeout(label, timeout_s)
        self._group_timeout_s = self.timeout_s  # what gloo enforces now
        self._seq = 0
        self._sends: list = []
        self._failure: BaseException | None = None
        self._owned = owned

    @classmethod
    def create(cls, parent, timeout_s: float, label: str, group_id: str = "") -> "TorchGroup":
        """Collective over parent's ranks (only them): a gloo group of cuflux's own."""
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(parent)
        me = dist.get_rank(parent)
        if len(ranks) == 1:  # nothing to exchange: no group of our own
            return cls(parent, timeout_s, label, group_id, owned=False)
        return cls(_new_gloo_group(ranks, timeout_s, label, "creating a gloo group", me),
                   timeout_s, label, group_id)

    @contextlib.contextmanager
    def _bounded(self, timeout_s: float):
        import torch.distributed.distributed_c10d as c10d

        set_timeout = getattr(c10d, "_set_pg_timeout", None)
        if timeout_s == self._group_timeout_s or set_timeout is None:
            yield
            return
        from datetime import timedelta

        set_timeout(timedelta(seconds=timeout_s), self.comm)
        try:
            yield
        finally:
            set_timeout(timedelta(seconds=self._group_timeout_s), self.comm)

    def allgather(self, obj: Any, timeout_s: float | None = None, what: str = "allgather") -> list:
        """Every rank's obj, in rank order (all_gather_object on the gloo group: pickled)."""
        import torch.distributed as dist

        self._check_usable(what)
        timeout_s = self.timeout_s if timeout_s is None else check_timeout(what, timeout_s)
        seq, self._seq = self._seq, self._seq + 1
        if self.size == 1:
            return [obj]
        got: list = [None] * self.size
        try:
            with self._bounded(timeout_s):
                dist.all_gather_object(got, (self.group_id, seq, what, obj), group=self.comm)
        except Exception as e:
            self._failure = CommTimeoutError(
                f"{self.label} {what}", self.rank, _peer_named(str(e), self.ranks, self.rank),
                timeout_s, f"torch.distributed gloo: {type(e).__name__}: {str(e)[:300]}")
            raise self._failure from e
        for p, (gid, their_seq, their_what, _) in enumerate(got):
            if (gid, their_seq, their_what) != (self.group_id, seq, what):
                self._failure = CufluxError(
                    f"{self.label}: rank {self.rank} is at host collective #{seq} ({what!r}) "
                    f"while rank {p} is at #{their_seq} ({their_what!r}): the ranks called "
                    "cuflux's collectives in different orders")
                raise self._failure
        return [item[3] for item in got]

    def exchange_digest(self, digest: int, timeout_s: float,
                        what: str = "exchange_digest") -> list[int]:
        """Every rank's 64-bit digest (an allgather: gloo keeps no per-tag queues)."""
        return [int(v) for v in self.allgather(int(digest), timeout_s, what)]

    def dup(self, what: str = "dup", timeout_s: float | None = None):
        """A new gloo group over the same ranks (bounded): an op's own."""
        self._check_usable(what)
        timeout_s = self.timeout_s if timeout_s is None else check_timeout(what, timeout_s)
        if self.size == 1:
            return self.comm
        return _new_gloo_group(self.ranks, timeout_s, self.label, what, self.rank)

    def free(self) -> None:
        """Destroy the gloo group (local; best effort). A group cuflux did not make is kept."""
        comm, self.comm = self.comm, None
        if comm is not None and self._owned:
            try:
                import torch.distributed as dist

                dist.destroy_process_group(comm)
            except Exception:
                pass


class TorchOpComm(OpComm, TorchGroup):
    """OpComm over a gloo group of the op's own (World.sub_comm on the torch route)."""

    def __init__(self, comm, timeout_s: float, op_id: str, parent: HostGroup):
        super().__init__(comm, timeout_s, op_id, parent)
        self._owned = parent.size > 1


# ---- the launcher --------------------------------------------------------------------------------
class Launch(NamedTuple):
    """What a launcher told this process through its environment."""

    launcher: str            # "torchrun" or "mpirun"
    rank: int
    size: int
    local_rank: int | None
    variables: str           # the variables it was read from, for messages


# (rank, size, local rank) variables of the MPI launchers, most specific first.
_MPI_ENV = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
            ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),
            ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"))
_TORCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # torchrun (and torch.distributed's env://)


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() else None


def launcher_from_env(env: Mapping[str, str]) -> tuple[Launch | None, Launch | None]:
    """(torchrun's Launch or None, an MPI launcher's Launch or None), from the environment."""
    def read(names, launcher):
        rank, size = _int_env(env, names[0]), _int_env(env, names[1])
        if rank is None or size is None:
            return None
        return Launch(launcher, rank, size, _int_env(env, names[2]),
                      f"{names[0]}={rank}, {names[1]}={size}")

    torch = read(_TORCH_ENV, "torchrun")
    mpi = next((m for m in (read(n, "mpirun") for n in _MPI_ENV) if m is not None), None)
    return torch, mpi


def choose_route(env: Mapping[str, str], torch_world_size: int | None = None) -> str:
    """"torch" or "mpi": what cuflux.init() with no communicator bootstraps on.

    torch_world_size: torch.distributed's world size when the caller initialised it (then the
    torch route), else None. torchrun's variables without an MPI launcher's: the torch route;
    an MPI launcher's: mpi; neither: mpi (one process, MPI's singleton). Launchers that
    disagree on the number of processes raise CufluxError saying what each one says."""
    torch, mpi = launcher_from_env(env)
    told = [(l.launcher, l.size, l.variables) for l in (torch, mpi) if l is not None]
    if torch_world_size is not None:
        told.append(("torch.distributed", torch_world_size,
                     f"torch.distributed.get_world_size()={torch_world_size}"))
    if len({size for _, size, _ in told}) > 1:
        raise CufluxError(
            "cuflux.init: the launchers disagree on the number of processes: "
            + "; ".join(f"{name} says {size} ({how})" for name, size, how in told)
            + ". Launch with one of them (torchrun or mpirun), or pass the communicator or "
            "process group to cuflux.init")
    if torch_world_size is not None or (torch is not None and mpi is None):
        return "torch"
    return "mpi"


def _torch_world_group(timeout_s: float | None):
    """torch.distributed's default group, initialised from torchrun's environment (env://)
    when the caller has not: gloo for host tensors, NCCL for CUDA tensors where CUDA is."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise CufluxError("cuflux.init: launched by torchrun (RANK and WORLD_SIZE are set) but "
                          f"torch cannot be imported ({e}): pip install torch, or launch with "
                          "mpirun") from e
    if not dist.is_initialized():
        from datetime import timedelta

        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend, timeout=timedelta(
            seconds=default_timeout_s() if timeout_s is None else timeout_s))
    return dist.group.WORLD


def _torch_world_size() -> int | None:
    """torch.distributed's world size when the caller initialised it, else None (torch is not
    imported for this: a caller who initialised it has imported it)."""
    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


# ---- the world ---------------------------------------------------------------------------------
class World:
    """The ranks of one communicator and the GPU each uses.

    World(comm=None, device=None, timeout_s=None, node_size=None): comm is any mpi4py
    intracommunicator (COMM_WORLD by default); device the GPU to use (default: choose_device,
    the node-local rank modulo the device count, so several ranks may share one GPU: how every
    multi-rank path is tested on a one-GPU machine); timeout_s bounds every host collective
    (default DEFAULT_TIMEOUT_S, or CUFLUX_HOST_TIMEOUT_S); node_size (default
    CUFLUX_NODE_SIZE, else unset) splits each group of ranks that reach each other by P2P into
    nodes of that many consecutive ranks, so one host emulates several nodes. `nodes` (a
    cuflux.nodes.NodeLayout) says which ranks share a node: ranks of one node map each other's
    memory; every node must hold as many ranks as the others. On a World of several nodes
    each op builds its cross-node form (cuflux.ops.across: the node's IPC op and a rail
    between nodes, issue 20); symmetric memory stays within a node. On a machine without a
    GPU `device` is None: the world still bootstraps (topology checks, argument checks), but
    ops raise NoDeviceError. The caller's current CUDA device is the same after __init__ as
    before.
    """

    # Ranks on this rank's GPU as the ops count them (ranks_on_my_gpu); None: from
    # the topology. split_nodes() sets a node World's to its parent's.
    gpu_sharers: int | None = None

    def __init__(self, comm=None, device: int | None = None, timeout_s: float | None = None,
                 node_size: int | None = None):
        global _NODE_LOCAL_RANK
        self.timeout_s = (default_timeout_s() if timeout_s is None
                          else check_timeout("World", timeout_s))
        if node_size is None:
            node_size = knobs.node_size()
        elif type(node_size) is not int or node_size < 1:
            raise ValueError(f"cuflux.init: node_size must be an int >= 1, got {node_size!r}")
        self.hostname = socket.gethostname()
        self._host: HostGroup | None = None
        self._num_ops = 0
        if is_torch_group(comm):
            # torch.distributed: a gloo group of cuflux's own over the caller's ranks, made by
            # them only and bounded by timeout_s (gloo's deadline), carries every collective.
            import torch.distributed as dist

            self.comm = comm
            self.rank, self.size = dist.get_rank(comm), dist.get_world_size(comm)
            world_rank, world_size = dist.get_rank(), dist.get_world_size()
            hello = TorchGroup.create(comm, self.timeout_s, "cuflux.init")
        else:
            from mpi4py import MPI

            self.comm = comm if comm is not None else MPI.COMM_WORLD
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
            world_rank, world_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
            # First contact on the caller's communicator (cuflux's tag), bounded and naming a
            # rank that never called init; then a duplicate for everything else.
            hello = HostGroup(self.comm, self.timeout_s, "cuflux.init")
        everyone = hello.allgather((self.hostname, world_rank, secrets.token_hex(8)),
                                   what="hello")
        group_id = hashlib.sha1("".join(t for _, _, t in everyone).encode()).hexdigest()[:16]
        if isinstance(hello, TorchGroup):  # already cuflux's own group: it carries the rest
            hello.label, hello.group_id = "World", group_id
            self._host = hello
        else:
            self._host = HostGroup(hello.dup("duplicating the communicator"), self.timeout_s,
                                   "World", group_id)
        self._hello = hello  # its isend requests (and their buffers) live until they complete
        same_host = [r for r, (h, _, _) in enumerate(everyone) if h == self.hostname]
        self.local_rank: int = same_host.index(self.rank)  # within this communicator
        self.local_size: int = len(same_host)
        if self.size == world_size:  # every process of COMM_WORLD is here
            _NODE_LOCAL_RANK = sorted(wr for h, wr, _ in everyone if h == self.hostname).index(
                world_rank)
        self.num_devices = device_count()
        env = local_rank_from_env(os.environ)
        self.device: int | None = choose_device(self.num_devices, device,
                                                env[1] if env else None, _NODE_LOCAL_RANK)
        previous = _current_device() if self.device is not None else None
        try:
            self.topology = self._discover()
            # Each rank's P2P row (without a GPU: the ranks of its host), then the nodes.
            mine = [l.p2p if self.device is not None else l.same_host
                    for l in self.topology.links]
            rows = self.allgather((self.hostname, mine, node_size), what="reachability")
        finally:
            if previous is not None and _current_device() != previous:
                from cupy.cuda import runtime

                runtime.setDevice(previous)
        sizes = sorted({str(ns) for _, _, ns in rows})
        if len(sizes) > 1:
            raise CufluxError(f"cuflux.init: the ranks were given different node sizes {sizes} "
                              "(World(node_size=...) or CUFLUX_NODE_SIZE)")
        from cuflux.nodes import node_layout

        self.nodes = node_layout([h for h, _, _ in rows], [p for _, p, _ in rows], node_size)

    # ---- collectives on the host (bounded: CommTimeoutError after timeout_s) ----------------
    def barrier(self, timeout_s: float | None = None, what: str = "World.barrier") -> None:
        self._host.barrier(timeout_s, what)

    def allgather(self, obj: Any, timeout_s: float | None = None,
                  what: str = "World.allgather") -> list:
        return self._host.allgather(obj, timeout_s, what)

    def check_same(self, value: Any, what: str, timeout_s: float | None = None) -> None:
        """Raise ValueError on every rank if `value` differs between ranks (cheap: a hash)."""
        # Through self.allgather, so a stand-in world with only allgather(obj) works too.
        _check_same(lambda o, label: (self.allgather(o) if timeout_s is None
                                      else self.allgather(o, timeout_s)), value, what)

    def sub_comm(self, tag: str, timeout_s: float | None = None) -> OpComm:
        """A communicator of an op's own (a duplicate), with an id every rank agrees on.

        Collective: the ranks must build their ops in the same order. The n-th call on every
        rank must pass the same tag (the op's name), or every rank raises CufluxError naming
        what each one builds. The id is "{tag}#{n}". See OpComm for how an op uses it.
        """
        n, self._num_ops = self._num_ops, self._num_ops + 1
        everyone = self.allgather((n, str(tag)), timeout_s, "sub_comm")
        if len(set(everyone)) > 1:
            raise CufluxError(
                "World.sub_comm: ops built in different orders on different ranks: "
                + ", ".join(f"rank {r} builds op #{i} {t!r}" for r, (i, t) in enumerate(everyone)))
        op_id = f"{tag}#{n}"
        comm = self._host.dup(f"sub_comm({op_id})", timeout_s)
        kind = TorchOpComm if isinstance(self._host, TorchGroup) else OpComm
        return kind(comm, self.timeout_s if timeout_s is None else timeout_s, op_id, self._host)

    def split_nodes(self, timeout_s: float | None = None) -> tuple["World", HostGroup]:
        """(node, rail) of this rank, for the cross-node paths (issue 20). Collective.

        node: a World of the ranks of this rank's node (same GPU, timeout and node size: a World
        of one node, where the ops' IPC paths run); rail: a host group of the ranks with this
        rank's node-local index, one per node in node order (the group a NCCL communicator of
        the rail spans; its ranks in World-rank order). Bounded: the ranks first agree on the
        layout (an allgather), so the splits that follow find every rank there. The caller owns
        both (node.close(), rail.free())."""
        layout = self.nodes
        self._num_splits = getattr(self, "_num_splits", 0) + 1  # the same count on every rank
        self.check_same((layout.nodes, self._num_splits), "split_nodes: the node layout",
                        timeout_s)
        node_ranks, rail_ranks = layout.node_peers(self.rank), layout.rail(self.rank)
        # An id of this split's own: a freed group's stray message never matches a later one's.
        gid = f"{self._host.group_id}/split{self._num_splits}"
        if isinstance(self._host, TorchGroup):
            # gloo groups made by their members only (use_local_synchronization).
            glob = self._host.ranks  # this World's rank -> global rank
            t = self.timeout_s if timeout_s is None else timeout_s
            node_comm = (self.comm if len(node_ranks) == self.size else
                         _new_gloo_group([glob[r] for r in node_ranks], t, "World",
                                         "split_nodes (node)", self.rank))
            rail = TorchGroup(
                _new_gloo_group([glob[r] for r in rail_ranks], t, "World", "split_nodes (rail)",
                                self.rank), t, "rail", f"{gid}/rail{layout.local_index(self.rank)}")
        else:
            both = self._host.dup("split_nodes", timeout_s)  # bounded; every rank is here
            try:
                node_comm = both.Split(layout.node_of(self.rank), self.rank)
                try:
                    rail = HostGroup(both.Split(layout.local_index(self.rank), self.rank),
                                     self.timeout_s, "rail",
                                     f"{gid}/rail{layout.local_index(self.rank)}")
                except BaseException:
                    _free_comm(node_comm)
                    raise
            finally:
                _free_comm(both)
        # A communicator made here (not the caller's own): the node World frees it on close.
        kind = TorchGroup if isinstance(self._host, TorchGroup) else HostGroup
        own = kind(node_comm, self.timeout_s, "node") if node_comm is not self.comm else None
        try:
            node = World(node_comm, device=self.device, timeout_s=self.timeout_s,
                         node_size=layout.node_size)
        except BaseException:
            rail.free()
            if own is not None:
                own.free()
            raise
        node._own_group = own
        # The node's ops size their co-resident grids by every rank on this GPU, not only
        # the node's (emulated nodes of one GPU): the parent World's count.
        node.gpu_sharers = ranks_on_my_gpu(self)
        return node, rail

    # ---- the device ----------------------------------------------------------------------------
    def device_context(self):
        """`with world.device_context():` makes this rank's GPU current inside the block and
        restores the caller's afterwards (a no-op without a GPU)."""
        if self.device is None:
            return contextlib.nullcontext()
        import cupy

        return cupy.cuda.Device(self.device)

    # ---- symmetric memory (collective calls) ------------------------------------------------
    def alloc_symmetric(self, shape, dtype, group: HostGroup | None = None):
        """Same-size buffer on every rank, mapped into every peer: a SymmetricBuffer."""
        from cuflux.symmetric import alloc_symmetric

        return alloc_symmetric(self, shape, dtype, group=group)

    def alloc_layout(self, layout, group: HostGroup | None = None, memory: str = "device"):
        """Symmetric buffer carved into named regions by a cuflux.symmetric.Layout; group: the
        op's OpComm (default: the World's own collectives); memory: "device" or "host"."""
        from cuflux.symmetric import SymmetricBuffer

        return SymmetricBuffer(self, layout, group=group, memory=memory)

    # ---- lifetime ------------------------------------------------------------------------------
    _own_group = None  # split_nodes: the node's communicator, made for this World

    def close(self) -> None:
        """Free the World's communicator (local; idempotent)."""
        if self._host is not None:
            self._host.free()
        own, self._own_group = self._own_group, None
        if own is not None:
            own.free()

    def __del__(self):
        if isinstance(getattr(self, "_host", None), TorchGroup):
            return  # close() destroys it; the garbage collector must not (a collective's state)
        try:
            from mpi4py import MPI

            # From the garbage collector, any thread may run this: only with full thread support.
            if self._host is not None and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
                self._host.free()
        except Exception:
            pass

    # ---- topology --------------------------------------------------------------------------
    def _pci_bus_id(self) -> str | None:
        if self.device is None:
            return None
        from cupy.cuda import runtime

        return runtime.deviceGetPCIBusId(self.device)

    def _discover(self) -> Topology:
        me = (self.hostname, self._pci_bus_id())
        everyone = self.allgather(me, what="topology")
        links = []
        for peer, (host, bus) in enumerate(everyone):
            same_host = host == self.hostname
            same_gpu = same_host and bus is not None and bus == me[1]
            if peer == self.rank:
                links.append(PeerLink(peer, True, True, True, "self"))
            elif same_gpu:
                links.append(PeerLink(peer, True, True, True, "same_gpu"))
            elif same_host and bus is not None and me[1] is not None:
                links.append(self._probe_link(peer, bus))
            else:
                links.append(PeerLink(peer, same_host, False, False, "none"))
        numa = knobs.numa_size()
        return Topology(self.rank, tuple(links), numa)

    def _probe_link(self, peer: int, bus: str) -> PeerLink:
        from cupy.cuda import runtime

        try:
            peer_dev = runtime.deviceGetByPCIBusId(bus)
        except runtime.CUDARuntimeError:
            # The peer's GPU is not visible to this process (a CUDA_VISIBLE_DEVICES per rank,
            # as Slurm's --gpu-bind sets): IPC cannot map its memory here, so no P2P; the
            # ranks fall into different nodes and reach each other through the rail.
            return PeerLink(peer, True, False, False, "none")
        p2p = bool(runtime.deviceCanAccessPeer(self.device, peer_dev))
        link = "none"
        if p2p:
            link = "nvlink" if _native_atomics(self.device, peer_dev) else "pcie"
        return PeerLink(peer, True, False, p2p, link)

    def __repr__(self) -> str:
        return (f"World(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
                f"device={self.device}, topology={self.topology.kind})")


def ranks_on_my_gpu(world) -> int:
    """Ranks of the world running on this rank's GPU, this one included. Their spinning grids
    run side by side (MPS) or time-sliced, so grids that must stay co-resident split the SMs
    between them. A node World from split_nodes() carries its parent's count (gpu_sharers):
    emulated nodes share a GPU with ranks outside the node too."""
    given = getattr(world, "gpu_sharers", None)
    if given:
        return given
    return 1 + sum(1 for link in world.topology.links
                   if link.same_gpu and link.peer != world.rank)


def _native_atomics(dev: int, peer_dev: int) -> bool:
    """NVLink peers support native atomics; PCIe peers (as a rule) do not."""
    try:
        from cuda.bindings import runtime as rt

        err, val = rt.cudaDeviceGetP2PAttribute(
            rt.cudaDeviceP2PAttr.cudaDevP2PAttrNativeAtomicSupported, dev, peer_dev)
        return err == rt.cudaError_t.cudaSuccess and val == 1
    except Exception:
        return False


# What init accepts, said in every refusal.
_COMM_ACCEPTED = ("an mpi4py intracommunicator (MPI.COMM_WORLD, or one made from it with "
                  "Split / Create), a torch.distributed ProcessGroup (dist.group.WORLD, or one "
                  "from dist.new_group) or None (what the launcher started: torchrun or mpirun)")


def _check_comm(comm):
    """The communicator or process group init bootstraps on (None: MPI.COMM_WORLD), or
    TypeError saying what init accepts; ValueError for MPI.COMM_NULL (a rank left out of a
    Split) and for a process group this rank is not in."""
    if is_torch_group(comm):
        import torch.distributed as dist

        if dist.get_rank(comm) < 0:
            raise ValueError("cuflux.init: this process is not in the torch.distributed group "
                             "it was given: call init only on the ranks of the group")
        return comm
    kind = type(comm)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if comm is not None and kind.__module__.split(".")[0] == "torch":
        raise TypeError(f"cuflux.init: comm is a torch object ({name}) but not a "
                        f"torch.distributed ProcessGroup; comm must be {_COMM_ACCEPTED}")
    from mpi4py import MPI

    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, MPI.Intracomm):
        return comm
    if isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_NULL:
            raise ValueError("cuflux.init: comm is MPI.COMM_NULL (this process is not in the "
                             "group; a Split with color MPI.UNDEFINED gives it): call init only "
                             "on the ranks of the group")
        raise TypeError(f"cuflux.init: comm must be {_COMM_ACCEPTED}; got an intercommunicator "
                        f"or another kind of communicator ({name})")
    hint = ""
    if isinstance(comm, str):
        hint = f" (pass the communicator itself: from mpi4py import MPI; MPI.{comm})" \
            if comm.isidentifier() and hasattr(MPI, comm) else ""
    raise TypeError(f"cuflux.init: comm must be {_COMM_ACCEPTED}, got {comm!r} "
                    f"({kind.__name__}){hint}")


def init(comm=None, device: int | None = None, timeout_s: float | None = None,
         node_size: int | None = None) -> World:
    """Bootstrap cuflux: a World (collective over the ranks of comm).

    comm: an mpi4py intracommunicator (MPI.COMM_WORLD, or one made from it with Split /
      Create), a torch.distributed ProcessGroup (cuflux makes a gloo group of its own over its
      ranks; mpi4py is not needed), or None: what the launcher started, read from its
      environment (choose_route): torchrun (RANK, WORLD_SIZE; torch.distributed is initialised
      from it when the caller has not) or torch.distributed already initialised -> its world
      group; mpirun (OMPI_COMM_WORLD_*, PMI_*) or no launcher -> MPI.COMM_WORLD. Launchers that
      disagree on the number of processes (WORLD_SIZE=2 in a one-rank MPI world) raise
      CufluxError. Anything else raises TypeError saying what is accepted; MPI.COMM_NULL
      raises ValueError. device, timeout_s, node_size: see World.
    """
    if comm is None:
        route = choose_route(os.environ, _torch_world_size())
        if route == "torch":
            comm = _torch_world_group(timeout_s)
        else:
            torch_env, _ = launcher_from_env(os.environ)
            try:
                from mpi4py import MPI
            except ImportError as e:
                raise CufluxError(f"cuflux.init: no torch.distributed launch found and mpi4py "
                                  f"cannot be imported ({e}): launch with torchrun, or pip "
                                  "install mpi4py and launch with mpirun") from e
            size = MPI.COMM_WORLD.Get_size()
            if torch_env is not None and torch_env.size != size:
                raise CufluxError(
                    f"cuflux.init: the launchers disagree on the number of processes: "
                    f"{torch_env.variables}, but the MPI world has {size} rank(s) (torchrun "
                    "does not start MPI: every process is a one-rank MPI world). Under "
                    "torchrun, pass a torch.distributed group or unset the MPI variables; under "
                    "mpirun, unset WORLD_SIZE")
    return World(_check_comm(comm), device=device, timeout_s=timeout_s, node_size=node_size)
