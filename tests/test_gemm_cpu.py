"""CPU tests of the GEMM family: both cores compile for their targets and emit the instructions
they are built on; the tile order formula; argument checks that need no GPU."""
import os
import pathlib
import shutil
import subprocess

import re

import numpy as np
import pytest

from cuflux import gemm_core, gemm_tuner, kernels
from cuflux.ops import gemm as G
from tests.kernels_cu import GEMM_HOOKS, GEMM_HOOKS_FAMILY


def _ptx(arch: str, names) -> str:
    return kernels.compile_ptx("gemm.cu", names, arch)


def _cuobjdump():
    exe = shutil.which("cuobjdump")
    if exe is None:
        try:
            import nvidia

            cand = pathlib.Path(nvidia.__path__[0]) / "cu13" / "bin" / "cuobjdump"
            exe = str(cand) if cand.exists() else None
        except Exception:
            exe = None
    return exe


def test_family_registered_for_both_targets():
    fam = kernels.families()["gemm.cu"]
    assert fam.min_arch == 80 and fam.directory is None  # the package's own
    assert any(n.startswith("gemm_sm90<") for n in fam.names)
    assert any(n.startswith("gemm_sm80<") for n in fam.names)
    assert not any("hooks" in n for n in fam.names)


def test_test_kernels_live_under_tests_not_in_the_package():
    """The hook-exercising kernels are the tests' (tests/kernels_cu/gemm_hooks.cu, registered
    with that directory); nothing of the package's kernels_cu defines them."""
    fam = kernels.families()["gemm_hooks.cu"]
    assert fam is GEMM_HOOKS_FAMILY and set(fam.names) == set(GEMM_HOOKS.values())
    assert fam.directory == pathlib.Path(__file__).resolve().parent / "kernels_cu"
    assert (fam.directory / fam.source).is_file()
    assert not (kernels.KERNEL_DIR / fam.source).exists()
    for path in kernels.KERNEL_DIR.rglob("*.cu*"):
        assert "gemm_hooks_sm" not in path.read_text(), path
    with pytest.raises(ValueError, match="family of the package"):
        kernels.register("gemm.cu", ["x"], directory=fam.directory)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("source", ["gemm.cu", "gemm_hooks.cu"])
def test_both_cores_compile(arch, source):
    fam = kernels.families()[source]
    cubin, lowered = kernels.compile_source(fam.source, fam.names, arch)
    assert cubin[:4] == b"\x7fELF"
    assert set(lowered) == set(fam.names)


def test_portable_tile_is_defined_once_and_python_agrees():
    """gemm_sm80.cuh defines the portable core's one tile (sm80::kTile*, TileConfig); every
    kernel on that core (gemm.cu, gemm_rs.cu, ag_gemm.cu, the tests' hooks) takes it from there,
    and cuflux.gemm_core.SM80 holds the same numbers."""
    header = (kernels.INCLUDE_DIR / "cuflux" / "gemm_sm80.cuh").read_text()
    got = {m.group(1): int(m.group(2))
           for m in re.finditer(r"\bk(Tile\w+) = (\d+)\s*[,;]", header)}
    sm80 = gemm_core.SM80
    assert got == {"TileM": sm80.bm, "TileN": sm80.bn, "TileK": sm80.bk,
                   "TileStages": sm80.stages, "TileWarpsM": sm80.warps_m,
                   "TileWarpsN": sm80.warps_n, "TileCtasPerSm": sm80.ctas_per_sm}
    assert "kTileThreads = 32 * kTileWarpsM * kTileWarpsN" in header
    assert sm80.threads == 256 and sm80.smem_bytes == 64 << 10 and G.SM80_CONFIG == sm80.name
    users = [kernels.KERNEL_DIR / s for s in ("gemm.cu", "gemm_rs.cu", "ag_gemm.cu")]
    for path in users + [GEMM_HOOKS_FAMILY.directory / GEMM_HOOKS_FAMILY.source]:
        text = path.read_text()
        assert "sm80::TileConfig<" in text, path
        assert "sm80::Config<" not in text, f"{path} spells out a tile of its own"
        assert "__launch_bounds__(sm80::kTileThreads, sm80::kTileCtasPerSm)" in text, path


def test_hopper_core_emits_wgmma_tma_setmaxnreg():
    cfg = G.SM90_CONFIGS[G.SM90_DEFAULT]
    names = [cfg.kernel("__nv_bfloat16", t) for t in (False, True)]
    ptx = _ptx("sm_90a", names)
    for instr in (f"wgmma.mma_async.sync.aligned.m64n{cfg.bn}k16.f32.bf16.bf16",
                  "cp.async.bulk.tensor.2d", "mbarrier.try_wait.parity", "setmaxnreg.inc",
                  "setmaxnreg.dec", "wgmma.wait_group"):
        assert instr in ptx, instr


def test_tma_store_epilogue_emits_bulk_stores():
    cfg = G.SM90_CONFIGS["256x128s4c1t"]
    ptx = _ptx("sm_90a", [cfg.kernel("__nv_bfloat16", False)])
    for instr in ("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group",
                  "cp.async.bulk.wait_group.read", "fence.proxy.async.shared::cta"):
        assert instr in ptx, instr


def test_hopper_core_is_empty_below_sm90a():
    ptx = _ptx("sm_80", [G.SM90_CONFIGS[G.SM90_DEFAULT].kernel("__nv_bfloat16", False),
                         "gemm_sm80<__nv_bfloat16, true>"])
    assert "wgmma" not in ptx and "cp.async.bulk.tensor" not in ptx
    for instr in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "cp.async.cg.shared.global",
                  "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16"):
        assert instr in ptx, instr


def test_sass_has_hgmma_when_cuobjdump_is_present(tmp_path):
    fam = kernels.families()["gemm.cu"]
    cubin, _ = kernels.compile_source(fam.source, fam.names, "sm_90a")
    exe = _cuobjdump()
    path = tmp_path / "gemm.cubin"
    path.write_bytes(cubin)
    if exe is None:  # CI image without the disassembler: the PTX test above still holds
        assert b"gemm_sm90" in cubin
        return
    env = dict(os.environ, PATH=os.path.dirname(exe) + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([exe, "-sass", str(path)], capture_output=True, text=True, env=env)
    if "nvdisasm" in out.stderr:  # cuobjdump without nvdisasm beside it
        assert b"gemm_sm90" in cubin
        return
    assert "HGMMA.64x256x16.F32.BF16" in out.stdout
    assert "UTMALDG.2D" in out.stdout


# ---- the tile order (mirror of gemm_hooks.cuh ChunkedScheduler::tile) ---------------------------
def _tile(slot, tiles_m, tiles_n, chunk_tiles_m, group_m, order):
    per_chunk = chunk_tiles_m * tiles_n
    visit, r = divmod(slot, per_chunk)
    row, tn = G.grouped_tile(r, chunk_tiles_m, tiles_n, group_m)
    tm = order(visit) * chunk_tiles_m + row
    return (tm, tn) if tm < tiles_m else None


@pytest.mark.parametrize("tiles_m,tiles_n,chunk,group", [(9, 5, 9, 4), (64, 32, 64, 8), (7, 3, 2, 3),
                                                          (13, 1, 4, 16), (1, 40, 1, 8)])
def test_tile_order_visits_every_tile_once(tiles_m, tiles_n, chunk, group):
    num_chunks = -(-tiles_m // chunk)
    for rank in range(3):
        order = lambda i: (i + rank) % num_chunks  # noqa: E731  rank-offset
        got = [_tile(s, tiles_m, tiles_n, chunk, group, order)
               for s in range(num_chunks * chunk * tiles_n)]
        got = [t for t in got if t is not None]
        assert sorted(got) == [(m, n) for m in range(tiles_m) for n in range(tiles_n)]
        first_chunk = got[0][0] // chunk
        assert first_chunk == rank % num_chunks  # rank r starts on chunk r


def test_listed_chunk_order_is_followed():
    order = [3, 0, 2, 1]
    tiles = [_tile(s, 8, 3, 2, 1, lambda i: order[i]) for s in range(8 * 3)]
    chunks_in_visit_order = [t[0] // 2 for t in tiles]
    assert chunks_in_visit_order == [c for c in order for _ in range(2 * 3)]


# ---- arguments --------------------------------------------------------------------------------------
def test_bad_layout_and_impl_are_named():
    a = np.zeros((8, 8), np.float32)
    with pytest.raises(ValueError, match="b_layout"):
        G.gemm(a, a, b_layout="tn")
    with pytest.raises(ValueError, match="impl"):
        G.gemm(a, a, impl="cuda")


def test_host_arrays_are_refused():
    a = np.zeros((8, 8), np.float32)
    with pytest.raises(TypeError, match=r"cuflux\.gemm: a "):
        G.gemm(a, a)


def test_config_smem_fits_one_sm():
    for cfg in G.SM90_CONFIGS.values():
        assert cfg.smem_bytes <= 227 * 1024, cfg.name
        assert cfg.bm in (128, 256) and cfg.bn in (128, 256) and cfg.cluster in (1, 2)
    assert set(G.TUNER_CANDIDATES) <= set(G.SM90_CONFIGS) and G.SM90_DEFAULT in G.SM90_CONFIGS


def test_pingpong_config_compiles_its_schedule():
    cfg = G.SM90_CONFIGS["128x128s7c1p"]
    assert cfg.pingpong and not cfg.tma_store and cfg.cluster == 1
    assert cfg.kernel("__half", True) == "gemm_sm90<__half, 128, 128, 7, 1, true, false, true>"
    assert G.SM90_CONFIGS["256x128s4c1"].kernel("__half", True).endswith("true, false>")
    for bad in (dict(bm=256, bn=128), dict(bm=128, bn=256), dict(bm=128, bn=128, tma_store=True)):
        with pytest.raises(ValueError, match="ping-pong"):
            G.Sm90Config(stages=4, cluster=1, pingpong=True, **bad)
    ptx = _ptx("sm_90a", [cfg.kernel("__nv_bfloat16", False)])
    for instr in ("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", "bar.arrive",
                  "bar.sync", "mbarrier.try_wait.parity", "setmaxnreg.inc"):
        assert instr in ptx, instr


def test_shape_class_and_heuristic():
    T = gemm_tuner
    assert T.shape_class(8192, 8192, 8192) == "13x13x13"
    assert T.shape_class(777, 1536, 2048) == "10x11x11"
    assert T.heuristic(4096, 8, 4096) in G.SM90_CONFIGS
    assert T.heuristic(4096, 4096, 4096) in G.SM90_CONFIGS
    assert T.heuristic(G.CUBLAS_BELOW_M - 1, 4096, 4096) == G.CUBLAS  # small M: cuBLAS
    assert G.core_heuristic(16, 4096, 4096) in G.SM90_CONFIGS  # the fused ops' core: never cuBLAS


# ---- the ping-pong consumers' protocol (mirror of gemm_sm90.cuh consume() with kPingpong) ------
def _pingpong_run(tiles, k_tiles, stages, seed, ordered=True):
    """Random interleavings of the producer and the two consumer warpgroups on a model of the
    ring: mbarrier parity waits (true once the phase of that parity completed, i.e. the current
    phase's parity differs), one reader per stage use, the ordering barriers as bar.sync (the
    owner) + bar.arrive (the other). Returns the (warpgroup, tile, k-step, data) reads; raises
    TimeoutError when the actors stop making progress (a deadlock), AssertionError on a barrier
    that two arrivals would complete."""
    import random

    rnd = random.Random(seed)
    full, empty, data = [0] * stages, [0] * stages, [None] * stages  # completed phases, contents
    bar = [[0, 0], [0, 0]]  # per order barrier: [arrivals pending, syncs waiting]
    reads = []

    def wait(phases, s, parity):
        while (phases[s] & 1) == parity:  # parity of the current (incomplete) phase
            yield

    def producer():
        for i in range(tiles * k_tiles):
            s = i % stages
            yield from wait(empty, s, ((i // stages) & 1) ^ 1)
            data[s] = i
            full[s] += 1

    def bar_sync(b):
        bar[b][1] += 1
        while bar[b][0] + bar[b][1] < 2:
            yield
        if bar[b][1]:  # the first of the two to see it complete resets it
            bar[b] = [0, 0]

    def bar_arrive(b):
        assert bar[b][0] == 0, "two arrivals before the sync: the barrier completes wrongly"
        bar[b][0] += 1  # a waiting sync completes on its next poll

    def consumer(wg):
        stage, phase, seq = 0, 0, 0
        for j in range(tiles):
            owner, seq = seq & 1, seq + 1
            if owner != wg:
                stage += k_tiles
                phase ^= (stage // stages) & 1
                stage %= stages
                continue
            if ordered and seq > 1:
                yield from bar_sync(wg)
            prev = 0
            for kb in range(k_tiles):
                yield from wait(full, stage, phase)
                reads.append((wg, j, kb, data[stage]))
                yield  # the wgmma are in flight
                if kb > 0:
                    empty[prev] += 1  # release (one reader per use)
                prev = stage
                stage += 1
                if stage == stages:
                    stage, phase = 0, phase ^ 1
            if ordered:
                bar_arrive(1 - wg)
            empty[prev] += 1
            yield  # the epilogue
        if ordered and seq > 0 and ((seq - 1) & 1) != wg:
            yield from bar_sync(wg)

    actors = [producer(), consumer(0), consumer(1)]
    for _ in range(200 * (tiles * k_tiles + 10)):  # far more steps than a live run needs
        if not actors:
            break
        a = rnd.choice(actors)
        try:
            next(a)
        except StopIteration:
            actors.remove(a)
    else:
        raise TimeoutError("no progress: deadlock", reads)
    assert bar == [[0, 0], [0, 0]], bar  # every arrival met its sync
    return reads


@pytest.mark.parametrize("tiles,k_tiles,stages", [(1, 3, 7), (2, 1, 7), (5, 16, 7), (7, 3, 2),
                                                  (6, 7, 7), (9, 2, 3), (4, 8, 3)])
def test_pingpong_protocol_reads_each_stage_in_order(tiles, k_tiles, stages):
    for seed in range(30):
        reads = _pingpong_run(tiles, k_tiles, stages, seed)
        want = [(j % 2, j, kb, j * k_tiles + kb) for j in range(tiles) for kb in range(k_tiles)]
        assert sorted(reads, key=lambda r: (r[1], r[2])) == want


def test_pingpong_protocol_needs_the_order_barrier():
    # Without it a warpgroup that skipped the other's tile may pass a parity wait one phase
    # early (the stage still holds the other's data) and then hang the ring: the barrier is a
    # correctness condition, not only a performance one.
    bad = 0
    for seed in range(20):
        try:
            reads = _pingpong_run(4, 8, 3, seed, ordered=False)
        except TimeoutError as e:  # the early pass also releases a wrong phase: a hang follows
            reads = e.args[1]
        bad += any(d != j * 8 + kb for _, j, kb, d in reads)
    assert bad > 0
