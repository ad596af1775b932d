"""CPU tests of issue 19's host-side reliability (no GPU needed, never skipped).

Bounded host collectives (a late or absent rank is named within the timeout), agreement on
symmetric set-up, op communicators built or closed in different orders, the GPU choice, what
device_count's failures mean, the environment on import, the watchdog's CPU release and its
failure path, and SymmetricBuffer.close(abort=True) on test doubles.
"""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from cuflux import errors as E
from cuflux import symmetric, watchdog
from cuflux import world as world_mod
from cuflux.errors import CommTimeoutError, CufluxError
from tests.fakes import FakeErrorRecord
from tests.mpi import ROOT, run_ranks

SLACK_S = 1.5  # scheduling slack on a loaded 2-core machine (ranks share the cores)


# ---- bounded host collectives ------------------------------------------------------------------
@pytest.mark.parametrize("op", ["barrier", "allgather"])
def test_absent_rank_is_named_within_the_timeout(op):
    res = run_ranks(4, "tests.cases_reliability:late_rank", timeout_s=120, late=2, op=op)
    for r, out in enumerate(res):
        if r == 2:
            assert out["skipped"]
            continue
        assert out["error"] == "CommTimeoutError", out
        assert out["peer"] == 2 and "rank 2" in out["message"], out
        assert 1.0 <= out["seconds"] < 1.0 + SLACK_S, out
        # The group is out of step now: the next collective refuses at once.
        assert out["after"]["error"] == "CufluxError" and "out of step" in out["after"]["message"]
        assert out["after"]["seconds"] < 0.5


def test_late_rank_times_out_its_peers_and_passes_itself():
    res = run_ranks(3, "tests.cases_reliability:late_rank", timeout_s=120, late=1, op="allgather",
                    sleep_s=2.5)
    for r in (0, 2):
        assert res[r]["error"] == "CommTimeoutError" and res[r]["peer"] == 1, res[r]
    # The late rank finds the messages its peers sent before giving up.
    assert res[1]["error"] is None and res[1]["result"] == [0, 10, 20], res[1]


def test_ranks_at_different_collectives_raise_instead_of_pairing():
    res = run_ranks(2, "tests.cases_reliability:mismatched_collectives", timeout_s=120)
    for out in res:
        assert out["error"] == "CufluxError", out
        assert "different orders" in out["message"], out
        assert "close buffers" in out["message"] and "exchange handles" in out["message"], out
        assert out["seconds"] < 2.0


# ---- agreed symmetric set-up (test doubles for the memory) -------------------------------------
def test_symmetric_set_up_succeeds_and_opens_every_peer():
    res = run_ranks(3, "tests.cases_reliability:symmetric_agreement", timeout_s=120)
    for r, out in enumerate(res):
        assert out["error"] is None, out
        ptrs = out["result"]
        assert len(ptrs) == 3 and ptrs[r] == 0x1000 * (r + 1)
        mem = out["mem"]
        assert len(mem["opened"]) == 2 and mem["freed"] == [] and mem["closed"] == []
        assert mem["set"] == [0x1000 * (r + 1)]


@pytest.mark.parametrize("stage", ["alloc", "open"])
def test_one_rank_failing_set_up_fails_every_rank_and_frees_everything(stage):
    res = run_ranks(3, "tests.cases_reliability:symmetric_agreement", timeout_s=120,
                    fail_rank=1, stage=stage)
    for r, out in enumerate(res):
        assert out["error"] == "CufluxError", out
        assert "rank(s) [1]" in out["message"], out
        assert "on purpose" in out["message"], out  # the failing rank's reason, on every rank
        mem = out["mem"]
        assert sorted(mem["freed"]) == sorted(mem["allocated"]), mem  # nothing kept
        assert sorted(mem["closed"]) == sorted(mem["opened"]), mem
        assert mem["set"] == [] and out["leaked"] == 0


def test_absent_rank_at_set_up_is_named_and_nothing_leaks():
    res = run_ranks(3, "tests.cases_reliability:symmetric_agreement", timeout_s=120,
                    absent_rank=2, bound_s=1.0)
    for r in (0, 1):
        out = res[r]
        assert out["error"] == "CommTimeoutError" and out["peer"] == 2, out
        # Nobody passed the allocation round, so nobody can have opened our handle: freed.
        assert out["mem"]["freed"] == out["mem"]["allocated"] and out["leaked"] == 0
    assert res[2]["absent"]


def test_host_memory_is_shared_between_ranks_and_leaves_no_file():
    res = run_ranks(3, "tests.cases_reliability:shared_host_memory", timeout_s=120)
    for me, out in enumerate(res):
        want = [1000 * p + me + 1 if p != me else 1000 * me + me + 1 for p in range(3)]
        assert out["got"] == want, (me, out)
        assert out["leftover"] == []


# ---- op communicators --------------------------------------------------------------------------
def test_sub_comm_agreed_in_order():
    res = run_ranks(3, "tests.cases_reliability:sub_comm_order", timeout_s=120)
    for out in res:
        assert out["error"] is None, out
        assert out["result"] == "AllGather#0" and out["second"] == "AllReduce#1"
        assert out["gathered"] == [0, 1, 2]


def test_sub_comm_built_in_different_orders_raises_on_every_rank():
    res = run_ranks(3, "tests.cases_reliability:sub_comm_order", timeout_s=120, swap_rank=2)
    for out in res:
        assert out["error"] == "CufluxError", out
        assert "different orders" in out["message"]
        assert "rank 2 builds op #0 'AllReduce'" in out["message"], out
        assert out["seconds"] < 2.0


def test_ops_closed_in_different_orders_raise_on_every_rank():
    res = run_ranks(2, "tests.cases_reliability:close_order", timeout_s=120, swap_rank=1)
    for out in res:
        assert out["error"] == "CufluxError", out
        assert "rank 0 closes AllGather#0, rank 1 closes AllReduce#1" in out["message"], out


# ---- GPU choice ---------------------------------------------------------------------------------
def test_choose_device():
    choose = world_mod.choose_device
    assert choose(0) is None  # no GPU: no device, whatever the rank
    assert choose(2, env_local_rank=3) == 1
    assert choose(8, env_local_rank=3, node_local_rank=5) == 3  # the launcher's word first
    assert choose(8, node_local_rank=5) == 5
    assert choose(8, device=6, env_local_rank=1) == 6  # device= wins
    with pytest.raises(ValueError, match="device=8 is not one of the 8"):
        choose(8, device=8)
    with pytest.raises(TypeError, match="device must be an int"):
        choose(8, device="0")
    with pytest.raises(world_mod.NoDeviceError, match="no CUDA device"):
        choose(0, device=0)
    with pytest.raises(CufluxError, match="pass device="):
        choose(8)  # a sub-communicator, no launcher variable, COMM_WORLD never seen


def test_local_rank_from_env_prefers_the_mpi_launcher():
    env = {"SLURM_LOCALID": "0", "LOCAL_RANK": "2", "MPI_LOCALRANKID": "3"}
    assert world_mod.local_rank_from_env(env) == ("MPI_LOCALRANKID", 3)
    assert world_mod.local_rank_from_env({"SLURM_LOCALID": "1"}) == ("SLURM_LOCALID", 1)
    assert world_mod.local_rank_from_env({"LOCAL_RANK": "x"}) is None
    assert world_mod.local_rank_from_env({}) is None


def test_node_local_rank_from_comm_world_serves_a_sub_communicator():
    res = run_ranks(4, "tests.cases_reliability:node_local_rank", timeout_s=120)
    for r, out in enumerate(res):
        assert out["computed"] == r and out["local_rank"] == r  # one host in tests
        assert out["sub_rank"] == r // 2 and out["pick"] == r % 4, out


def test_world_timeout_is_validated(monkeypatch):
    for bad in (0, -1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="finite number of seconds"):
            world_mod.check_timeout("World", bad)
    monkeypatch.setenv(world_mod.TIMEOUT_ENV, "nan")
    with pytest.raises(ValueError, match=world_mod.TIMEOUT_ENV):
        world_mod.default_timeout_s()
    monkeypatch.setenv(world_mod.TIMEOUT_ENV, "7.5")
    assert world_mod.default_timeout_s() == 7.5


# ---- what device_count's failures mean ----------------------------------------------------------
def test_no_gpu_reads_as_zero():
    classify = world_mod.classify_device_error
    assert classify(100, driver_present=True) == 0  # cudaErrorNoDevice
    assert classify(35, driver_present=False) == 0  # no libcuda: no driver at all


def test_wrong_extra_or_old_driver_raises_and_says_what_to_install():
    classify = world_mod.classify_device_error
    with pytest.raises(world_mod.CudaSetupError, match=r"cuflux\[cuda12\]") as e:
        classify(35, driver_present=True, driver_version=12040, runtime_version=13000)
    assert "CUDA 12.4" in str(e.value) and "CUDA 13.0" in str(e.value)
    with pytest.raises(world_mod.CudaSetupError, match="update the NVIDIA driver"):
        classify(35, driver_present=True, driver_version=11080, runtime_version=12060)
    with pytest.raises(world_mod.CudaSetupError, match="could not start"):
        classify(3, driver_present=True, message="initialization error")
    assert issubclass(world_mod.CudaSetupError, CufluxError)


def test_device_count_without_cupy_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    with pytest.raises(world_mod.CudaSetupError, match="needs CuPy"):
        world_mod.device_count()


def test_device_count_here_is_honest():
    present, _ = world_mod._driver_probe()
    n = world_mod.device_count()  # must not raise on this machine
    if not present:
        assert n == 0
        with pytest.raises(world_mod.NoDeviceError,
                           match="AllGather: needs a CUDA device; no NVIDIA driver"):
            world_mod.require_device("AllGather")


def test_require_device_says_which_op(monkeypatch):
    monkeypatch.setattr(world_mod, "_device_count_and_reason",
                        lambda: (0, "CUDA sees no device (CUDA_VISIBLE_DEVICES='')"))
    with pytest.raises(world_mod.NoDeviceError,
                       match=r"^All2AllHeads: needs a CUDA device; CUDA sees no device"):
        world_mod.require_device("All2AllHeads")
    monkeypatch.setattr(world_mod, "_device_count_and_reason", lambda: (2, ""))
    assert world_mod.require_device("All2AllHeads") == 2


# ---- the environment on import -------------------------------------------------------------------
def test_import_sets_only_nccl_nvls():
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING", "NCCL_NVLS_ENABLE")}
    env["PYTHONPATH"] = ROOT
    code = ("import os, cuflux; print(repr(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')), "
            "repr(os.environ.get('CUDA_MODULE_LOADING')), os.environ.get('NCCL_NVLS_ENABLE'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None", "0"], out.stdout
    env.update(NCCL_NVLS_ENABLE="1", CUDA_DEVICE_MAX_CONNECTIONS="1")  # the caller's values stay
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.split() == ["'1'", "None", "1"], out.stdout


def test_one_connection_warns_once(monkeypatch):
    monkeypatch.setattr(watchdog, "_warned_one_connection", False)
    assert not watchdog.warn_if_one_connection({"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    with pytest.warns(RuntimeWarning, match="one hardware queue"):
        assert watchdog.warn_if_one_connection({"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert not watchdog.warn_if_one_connection({"CUDA_DEVICE_MAX_CONNECTIONS": "1"})


# ---- the watchdog: CPU release of host-mapped flags, and its failure path ----------------------
class FakeEvent:
    def __init__(self, *a, **k):
        self.done = False

    def record(self, stream):
        pass


class BrokenEvent(FakeEvent):
    @property
    def done(self):
        raise RuntimeError("cudaErrorIllegalAddress (on purpose)")

    @done.setter
    def done(self, value):
        pass


def _waiter(monkeypatch, timeout_s, host_flags, event=FakeEvent):
    """A StreamWaiter without CUDA: fake events, no stream wait; the flags in `host_flags` (a
    NumPy uint32 array standing for host-mapped memory) are known to be host-mapped."""
    import cupy

    monkeypatch.setattr(cupy.cuda, "Event", event)
    monkeypatch.setattr(watchdog.driver, "stream_wait_value32", lambda *a, **k: None)
    base = host_flags.ctypes.data
    monkeypatch.setattr(watchdog.driver, "host_address",
                        lambda p: base + (p - 0x9000) if 0x9000 <= p < 0x9000 + 4 * host_flags.size
                        else None)
    w = watchdog.StreamWaiter.__new__(watchdog.StreamWaiter)
    w.err, w.device = FakeErrorRecord(timeout_s, rank=3), None
    w.op_code = E.OP_CODES["AllGather"]
    w._pending, w._lock, w._thread, w._stop = {}, threading.Lock(), None, threading.Event()
    w._host_words = {}

    def no_gpu(*a, **k):
        raise AssertionError("a host-mapped flag must be released by the CPU, not a stream")
    w._expire_device = no_gpu
    return w


def test_host_mapped_wait_is_released_by_a_cpu_store(monkeypatch):
    flags = np.zeros(4, dtype=np.uint32)
    flags[2] = 4  # the peer got as far as epoch 4
    w = _waiter(monkeypatch, 0.1, flags)
    try:
        w.wait(7, 0x9000 + 8, 5, peer=1, index=2)
        (item,) = list(w._pending[7])
        assert item[8] == flags.ctypes.data + 8
        item[0].done = True  # the stream reaches the wait
        time.sleep(0.4)
        assert int(flags[2]) == 5  # released: the awaited value, stored by the CPU
        words = w.err.words
        assert int(words[E.STATUS]) == E.STATUS_TIMEOUT and int(words[E.PEER]) == 1
        assert int(words[E.OBSERVED]) == 4 and int(words[E.EXPECTED]) == 5
        assert int(words[E.INDEX]) == 2 and int(words[E.RANK]) == 3
        assert w.fault is None
    finally:
        w.close()


def test_watchdog_thread_failure_is_recorded_and_raised(monkeypatch):
    flags = np.zeros(2, dtype=np.uint32)
    w = _waiter(monkeypatch, 30, flags, event=BrokenEvent)
    try:
        w.wait(1, 0x9000, 9, peer=2)
        deadline = time.monotonic() + 5
        while w.fault is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(w.fault, RuntimeError) and "on purpose" in str(w.fault)
        assert w.err.fault is w.fault
        words = w.err.words
        assert int(words[E.STATUS]) == E.STATUS_ABORTED and int(words[E.ABORT]) == 1
        assert int(flags[0]) == 9  # the pending host-mapped wait was released on the way out
        with pytest.raises(CufluxError, match="AllGather: the stream-wait watchdog failed"):
            w.wait(1, 0x9004, 1, peer=2)  # the op's next call raises it
        with pytest.raises(CufluxError, match="on purpose"):
            w.check()
    finally:
        w.close()


# ---- SymmetricBuffer.close on test doubles ------------------------------------------------------
class FakeGroup:
    def __init__(self, size, fail=None):
        self.rank, self.size, self.fail, self.calls = 0, size, fail, []

    def barrier(self, timeout_s=None, what=""):
        self.calls.append(what)
        if self.fail is not None:
            raise self.fail


class FakeStream:
    def __init__(self, done):
        self.done = done


def _buffer(size, memory="device", fail=None):
    from tests.cases_reliability import FakeMemory

    buf = symmetric.SymmetricBuffer.__new__(symmetric.SymmetricBuffer)
    buf.memory, buf.num_bytes, buf._closed = memory, 4096, False
    buf.name = "SymmetricBuffer #0"
    buf.group = FakeGroup(size, fail)
    buf._mem = FakeMemory(0)
    buf._base = buf._mem.alloc(4096)
    buf._opened = [buf._mem.open(("handle", p, 0x1000 * (p + 1))) for p in range(1, size)]
    buf.base_ptrs = [buf._base] + buf._opened
    buf._synchronize_device = lambda: None
    return buf


def test_abort_close_is_local_and_keeps_memory_a_peer_may_write():
    before = symmetric.leaked_bytes()
    buf = _buffer(3)
    t0 = time.monotonic()
    buf.close(abort=True)  # streams unknown: nothing is unmapped, nothing freed
    assert time.monotonic() - t0 < 0.1 and buf.group.calls == []
    assert buf._mem.closed == [] and buf._mem.freed == [] and buf.closed
    assert symmetric.leaked_bytes() - before == 3 * 4096
    buf.close(abort=True)  # idempotent

    buf = _buffer(3)
    buf.close(abort=True, streams=[FakeStream(True)])  # our work is done: unmap the peers
    assert sorted(buf._mem.closed) == sorted(buf._mem.opened) and buf._mem.freed == []
    buf = _buffer(3)
    buf.close(abort=True, streams=[FakeStream(True), FakeStream(False)])  # still running
    assert buf._mem.closed == []
    buf = _buffer(1)
    buf.close(abort=True, streams=[])  # no peer: freeing is safe
    assert buf._mem.freed == buf._mem.allocated
    buf = _buffer(3, memory="host")
    buf.close(abort=True, streams=[])  # host pages: the peers keep their own mappings
    assert buf._mem.freed == buf._mem.allocated


def test_close_with_a_dead_peer_raises_and_leaks_rather_than_frees():
    buf = _buffer(2, fail=CommTimeoutError("SymmetricBuffer.close", 0, 1, 1.0))
    with pytest.raises(CommTimeoutError):
        buf.close()
    assert buf._mem.freed == [] and sorted(buf._mem.closed) == sorted(buf._mem.opened)

    buf = _buffer(2)
    buf.close()
    assert buf.group.calls == ["SymmetricBuffer #0 close: every rank done with it",
                               "SymmetricBuffer #0 close: every rank unmapped it"]
    assert buf._mem.freed == buf._mem.allocated


def test_context_exit_on_a_timeout_aborts():
    buf = _buffer(2)
    with pytest.raises(CommTimeoutError):
        with buf:
            raise CommTimeoutError("AllGather", 0, 1, 1.0)
    assert buf.closed and buf.group.calls == []  # no collective after a peer timed out
