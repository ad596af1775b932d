"""CPU tests of the kernel cache: one compile per machine under a lock, the one-line notice, a
private cache directory, hash-checked cubins, family registration without an import circle, and
`python -m cuflux.compile`. No GPU needed: NVRTC only."""
from __future__ import annotations

import fcntl
import hashlib
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

from cuflux import kernels

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTICE = "cuflux: compiling kernels_cu/"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory for this test (and the processes it starts)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("CUFLUX_CACHE_DIR", str(d))
    monkeypatch.setattr(kernels, "_NOTICE_GIVEN", False)
    return d


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """kernels_cu/ replaced by two one-line kernels: compiles in milliseconds."""
    kdir = tmp_path / "kernels_cu"
    (kdir / "include" / "cuflux").mkdir(parents=True)
    (kdir / "include" / "cuflux" / "v.cuh").write_text("#define VALUE 7\n")
    for name in ("a", "b"):
        (kdir / f"{name}.cu").write_text(
            '#include <cuflux/v.cuh>\n'
            f'extern "C" __global__ void {name}(int* x) {{ *x = VALUE; }}\n')
    monkeypatch.setattr(kernels, "KERNEL_DIR", kdir)
    monkeypatch.setattr(kernels, "INCLUDE_DIR", kdir / "include")
    return kdir


def _env(cache_dir: pathlib.Path) -> dict:
    env = dict(os.environ, CUFLUX_CACHE_DIR=str(cache_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


# A rank of its own: waits for `go`, compiles signal.cu for sm_80, prints the cubin's SHA-256.
# NVRTC is slowed by 1 s and every call to it is logged, so two processes that both missed the
# cache overlap for certain, and the log shows how many of them compiled.
_RANK = textwrap.dedent("""
    import hashlib, os, sys, time
    from cuflux import kernels

    log, ready, go = sys.argv[1:4]
    real = kernels._run_nvrtc

    def slow(*args, **kwargs):
        with open(log, "a") as f:
            f.write(f"compile {os.getpid()}\\n")
        time.sleep(1.0)
        return real(*args, **kwargs)

    kernels._run_nvrtc = slow
    fam = kernels.families()["signal.cu"]
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    cubin, lowered = kernels.compile_source(fam.source, fam.names, "sm_80")
    print(hashlib.sha256(cubin).hexdigest(), sorted(lowered))
""")


def test_two_processes_compile_once_and_share_the_cubin(tmp_path, cache):
    log, go = tmp_path / "nvrtc.log", tmp_path / "go"
    procs, readies = [], []
    for i in range(2):
        ready = tmp_path / f"ready{i}"
        readies.append(ready)
        procs.append(subprocess.Popen(
            [sys.executable, "-c", _RANK, str(log), str(ready), str(go)], env=_env(cache),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in readies):
        assert time.monotonic() < deadline, "ranks never got ready"
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len(log.read_text().splitlines()) == 1, "exactly one process may compile"
    assert outs[0][0] == outs[1][0] and outs[0][0].strip()
    assert sum(err.count(NOTICE) for _, err in outs) == 1, outs
    cubin = next(cache.glob("signal-sm_80-*.cubin")).read_bytes()
    assert hashlib.sha256(cubin).hexdigest() == outs[0][0].split()[0]


def test_a_held_lock_times_out_with_a_clear_error(cache, tiny, monkeypatch):
    entry = kernels.cache_entry("a.cu", ["a"], "sm_80")
    fd = os.open(entry.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process compiling the same cubin, stuck
        monkeypatch.setattr(kernels, "COMPILE_LOCK_TIMEOUT_S", 0.3)
        t0 = time.monotonic()
        with pytest.raises(kernels.CompileError, match=r"another process compiling a\.cu") as e:
            kernels.compile_source("a.cu", ["a"], "sm_80")
        assert 0.3 <= time.monotonic() - t0 < 5
        assert str(entry.lock_path) in str(e.value) and "python -m cuflux.compile" in str(e.value)
    finally:
        os.close(fd)
    kernels.compile_source("a.cu", ["a"], "sm_80")  # the lock released: it compiles


def test_waiter_takes_the_cubin_compiled_while_it_waited(cache, tiny, monkeypatch):
    """After the lock, the cache is read again: a cubin written meanwhile is not compiled twice."""
    entry = kernels.cache_entry("a.cu", ["a"], "sm_80")
    cubin, lowered = kernels._run_nvrtc((tiny / "a.cu").read_bytes(), "a.cu", ["a"], "sm_80",
                                        kernels._options("sm_80"))
    real_flock = fcntl.flock

    def flock(fd, op):  # the other process finishes just as this one gets the lock
        kernels.write_atomically(entry.cubin_path, cubin)
        kernels.write_atomically(entry.meta_path, (
            '{"lowered": {"a": "a"}, "cubin_sha256": "%s"}'
            % hashlib.sha256(cubin).hexdigest()).encode())
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setattr(kernels, "_run_nvrtc", lambda *a: pytest.fail("compiled twice"))
    assert kernels.compile_source("a.cu", ["a"], "sm_80") == (cubin, {"a": "a"})


def test_notice_is_one_line_once_per_process(cache, tiny, capsys):
    kernels.compile_source("a.cu", ["a"], "sm_80")
    kernels.compile_source("b.cu", ["b"], "sm_80")
    kernels.compile_source("a.cu", ["a"], "sm_90a")
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("cuflux:")]
    assert len(lines) == 1 and lines[0].startswith(NOTICE + "a.cu for sm_80"), err
    assert "40 s" in lines[0] and str(cache) in lines[0] and "python -m cuflux.compile" in lines[0]
    kernels.compile_source("a.cu", ["a"], "sm_80")  # cached: silent
    assert capsys.readouterr().err == ""


def test_cache_dir_is_created_private(cache, tiny):
    kernels.compile_source("a.cu", ["a"], "sm_80")
    assert cache.stat().st_mode & 0o777 == 0o700
    assert cache.stat().st_uid == os.getuid()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_cache_dir_writable_by_others_is_refused(cache, tiny, mode):
    cache.mkdir()
    cache.chmod(mode)
    with pytest.raises(kernels.CacheDirError) as e:
        kernels.compile_source("a.cu", ["a"], "sm_80")
    msg = str(e.value)
    assert str(cache) in msg and f"{mode:04o}" in msg and "CUFLUX_CACHE_DIR" in msg, msg
    assert not list(cache.iterdir()), "nothing may be written into a refused directory"
    cache.chmod(0o755)  # not writable by others: accepted
    kernels.compile_source("a.cu", ["a"], "sm_80")


def test_cache_dir_of_another_user_is_refused(cache, tiny, monkeypatch):
    cache.mkdir(mode=0o700)
    if os.getuid() == 0:
        os.chown(cache, 12345, -1)  # as root: give it away
    else:
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)  # as a user: be someone else
    with pytest.raises(kernels.CacheDirError, match="owned by uid") as e:
        kernels.compile_source("a.cu", ["a"], "sm_80")
    assert str(cache) in str(e.value) and "CUFLUX_CACHE_DIR" in str(e.value)


def test_cache_dir_that_is_a_file_is_refused(tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("")
    monkeypatch.setenv("CUFLUX_CACHE_DIR", str(f))
    with pytest.raises(kernels.CacheDirError, match="CUFLUX_CACHE_DIR"):
        kernels.cache_dir()


def test_cubin_not_matching_its_hash_is_recompiled(cache, tiny, capsys):
    good, _ = kernels.compile_source("a.cu", ["a"], "sm_80")
    path = next(cache.glob("a-sm_80-*.cubin"))
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    path.write_bytes(bytes(bad))
    with pytest.warns(RuntimeWarning, match="does not match the SHA-256"):
        got, lowered = kernels.compile_source("a.cu", ["a"], "sm_80")
    assert got == good and path.read_bytes() == good and lowered == {"a": "a"}
    # metadata gone or unreadable: recompiled as well
    meta = path.with_suffix(".json")
    meta.write_text("{not json")
    with pytest.warns(RuntimeWarning):
        assert kernels.compile_source("a.cu", ["a"], "sm_80")[0] == good
    meta.unlink()
    assert kernels.compile_source("a.cu", ["a"], "sm_80")[0] == good


def test_compiling_leaves_python_one_byte_objects_intact(cache, tiny):
    """NVRTC's log of a clean compile is one NUL; written into a bytes buffer of length one it
    overwrote CPython's shared b" " (every later b" " read b"\\0")."""
    kernels.compile_source("a.cu", ["a"], "sm_80")
    kernels.compile_ptx("b.cu", ["b"], "sm_80")
    assert bytes([32])[0] == 32 and " ".encode()[0] == 32


def test_temporaries_are_unpredictable_and_never_follow_links(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    target = tmp_path / "x.cubin"
    target.symlink_to(victim)  # planted where the cubin goes
    for guess in (f"x.tmp{os.getpid()}", f"x.cubin.tmp{os.getpid()}", "x.cubin.tmp"):
        (tmp_path / guess).symlink_to(victim)  # and where a predictable temporary would go
    names = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda s, d: (names.append(s), real_replace(s, d)))
    kernels.write_atomically(target, b"new")
    assert victim.read_bytes() == b"keep"
    assert not target.is_symlink() and target.read_bytes() == b"new"
    assert len(names) == 1 and os.path.dirname(names[0]) == str(tmp_path)
    assert not os.path.exists(names[0])
    kernels.write_atomically(target, b"newer")
    assert names[0] != names[1], "temporary names must not repeat"


def test_failed_write_leaves_no_temporary(tmp_path, monkeypatch):
    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        kernels.write_atomically(tmp_path / "x.cubin", b"data")
    assert list(tmp_path.iterdir()) == []


def test_kernels_imports_no_op_module():
    """kernels.py sits below the ops: importing it loads no cuflux.ops module (the package's
    own __init__ is bypassed so only kernels.py's imports count); families() then finds every
    family through its table."""
    code = textwrap.dedent(f"""
        import sys, types
        pkg = types.ModuleType("cuflux")
        pkg.__path__ = [{str(ROOT / "cuflux")!r}]
        sys.modules["cuflux"] = pkg
        import cuflux.kernels as k
        loaded = sorted(m for m in sys.modules if m.startswith("cuflux.ops"))
        assert not loaded, loaded
        fams = k.families()
        print(" ".join(sorted(fams)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    on_disk = sorted(p.name for p in (ROOT / "kernels_cu").glob("*.cu"))
    assert out.stdout.split() == on_disk


def test_every_kernel_source_has_a_registering_module():
    on_disk = {p.name for p in kernels.KERNEL_DIR.glob("*.cu")}
    assert on_disk <= set(kernels._FAMILY_MODULES), on_disk - set(kernels._FAMILY_MODULES)
    fams = kernels.families()
    assert on_disk <= set(fams)
    for source, fam in fams.items():
        assert fam.source == source and fam.names


def test_precompile_command_help():
    out = subprocess.run([sys.executable, "-m", "cuflux.compile", "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=_env(ROOT / "unused-cache"))
    assert out.returncode == 0, out.stderr
    assert "--arch" in out.stdout and "--cache-dir" in out.stdout and "no GPU" in out.stdout
    assert not (ROOT / "unused-cache").exists()


def test_precompile_command_fills_the_cache(tmp_path):
    cache_dir = tmp_path / "image-cache"
    cmd = [sys.executable, "-m", "cuflux.compile", "--arch", "sm_80", "--family", "signal.cu",
           "--cache-dir", str(cache_dir)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                           env=_env(tmp_path / "other"))
    assert first.returncode == 0, first.stderr
    cubins = list(cache_dir.glob("signal-sm_80-*.cubin"))
    assert len(cubins) == 1 and str(cubins[0]) in first.stdout and "compiled in" in first.stdout
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env=_env(tmp_path / "other"))
    assert second.returncode == 0 and "already cached" in second.stdout, second.stdout
    bad = subprocess.run(cmd[:3] + ["--arch", "80"], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=_env(tmp_path / "other"))
    assert bad.returncode == 2 and "sm_80 or sm_90a" in bad.stderr
