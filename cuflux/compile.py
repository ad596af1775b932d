"""Compile every cuflux kernel ahead of time: `python -m cuflux.compile [--arch sm_90a ...]`.

The first use of an op compiles its kernels_cu/*.cu with NVRTC (up to ~40 s a file) into the
kernel cache; this command does that for every kernel family now, for an image build or a login
node, and needs no GPU. The cache is CUFLUX_CACHE_DIR (else $XDG_CACHE_HOME/cuflux, else
~/.cache/cuflux); the run that uses it must see the same directory and the same NVRTC version.

    python -m cuflux.compile                  # the visible GPUs' targets, else sm_80 + sm_90a
    python -m cuflux.compile --arch sm_90a    # H100 / H200
    python -m cuflux.compile --arch sm_80 --arch sm_90a --cache-dir /opt/cuflux-cache
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

from cuflux import knobs

DEFAULT_ARCHS = ("sm_80", "sm_90a")
_ARCH = re.compile(r"sm_\d{2,3}[af]?")


def _visible_archs() -> tuple[list[str], str]:
    """The targets of the GPUs this process sees, or the defaults with the reason there are none."""
    try:
        import cupy

        from cuflux import kernels

        count = cupy.cuda.runtime.getDeviceCount()
        archs = sorted({kernels.device_arch(i) for i in range(count)})
    except Exception as e:  # no CuPy, no driver, no device: the defaults, with the reason said
        reason = f"no GPU visible ({(str(e) or type(e).__name__).split(':')[0][:80]})"
    else:
        if archs:
            return archs, "the visible GPUs"
        reason = "no GPU visible"
    return list(DEFAULT_ARCHS), f"{reason}: the portable sm_80 target and Hopper's sm_90a"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cuflux.compile",
        description="Compile every cuflux kernel family with NVRTC into the kernel cache, so "
                    "that no process compiles at first use. Needs no GPU.")
    p.add_argument("--arch", action="append", metavar="sm_XY",
                   help="NVRTC target, repeatable: sm_90a (H100/H200, the fast GEMM path), "
                        "sm_80 (A100; the portable path, also runs on later GPUs), sm_89, ... "
                        "Default: the visible GPUs' targets, else sm_80 and sm_90a.")
    p.add_argument("--family", action="append", metavar="FILE.cu",
                   help="compile only this kernel family (repeatable); default: every one")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="the kernel cache to fill (sets CUFLUX_CACHE_DIR for this run); a later "
                        "run must set CUFLUX_CACHE_DIR=DIR to use it")
    args = p.parse_args(argv)

    for arch in args.arch or ():
        if not _ARCH.fullmatch(arch):
            p.error(f"--arch {arch!r}: expected an NVRTC target such as sm_80 or sm_90a")
    if args.cache_dir:
        os.environ[knobs.CACHE_DIR.name] = os.path.abspath(args.cache_dir)  # for this process

    from cuflux import kernels

    if args.arch:
        archs, why = args.arch, "--arch"
    else:
        archs, why = _visible_archs()
    try:
        fams = kernels.families()
        if args.family:
            unknown = sorted(set(args.family) - set(fams))
            if unknown:
                p.error(f"--family {', '.join(unknown)}: not a kernel family; known: "
                        f"{', '.join(sorted(fams))}")
            fams = {s: fams[s] for s in args.family}
        cache = kernels.cache_dir()
        print(f"cuflux: compiling {len(fams)} kernel famil{'y' if len(fams) == 1 else 'ies'} for "
              f"{', '.join(archs)} ({why}) into {cache}", flush=True)
        built = cached = 0
        t_all = time.monotonic()
        for source in sorted(fams):
            fam = fams[source]
            for arch in archs:
                if kernels.arch_number(arch) < fam.min_arch:
                    print(f"  {source:<12} {arch:<7} skipped: needs compute capability >= "
                          f"{fam.min_arch}", flush=True)
                    continue
                print(f"  {source:<12} {arch:<7} ", end="", flush=True)
                t0 = time.monotonic()
                got = kernels.compile_family(fam, arch, notice=False)
                how = (f"compiled in {time.monotonic() - t0:5.1f} s" if got.compiled
                       else "already cached      ")
                built, cached = built + got.compiled, cached + (not got.compiled)
                print(f"{len(got.cubin) / 1024:7.0f} KiB  {how}  {got.path}", flush=True)
    except kernels.CompileError as e:
        print(f"\n{e}", file=sys.stderr)
        return 1
    print(f"cuflux: {built} compiled, {cached} already cached, in "
          f"{time.monotonic() - t_all:.1f} s; cache {cache}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
