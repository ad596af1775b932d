#!/usr/bin/env bash
# Fill .cubins/ (git-ignored) with every kernel compiled for sm_90a by NVRTC 13.0, the NVRTC of
# the lent H200 machine, so a device call that carries .cubins (run's carry: [".cubins"]) loads
# them instead of compiling (~2 minutes of device time per fresh machine). The cache key holds
# the NVRTC major.minor: a cache built by another NVRTC is simply not used there.
#   bash scripts/precompile.sh            # on the CPU machine, before a device call
set -euo pipefail
cd "$(dirname "$0")/.."
NV=/tmp/cuflux-nvrtc-13.0
if [ ! -e "$NV/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python -m pip install -q --no-deps --target "$NV" "nvidia-cuda-nvrtc==13.0.*"
fi
grep -qx "/.cubins/" .git/info/exclude 2>/dev/null || echo "/.cubins/" >> .git/info/exclude
rm -rf .cubins && mkdir -p .cubins
export LD_LIBRARY_PATH="$NV/nvidia/cu13/lib" LD_PRELOAD="$NV/nvidia/cu13/lib/libnvrtc.so.13"
export CUFLUX_CACHE_DIR="$(pwd)/.cubins" PYTHONPATH="$(pwd)"
python -c "
from cuda.bindings import nvrtc
from cuflux import kernels
import tests.kernels_cu  # noqa: F401  (the tests' own kernel family registers on import)
assert nvrtc.nvrtcVersion()[1:] == (13, 0), nvrtc.nvrtcVersion()
print(kernels.compile_all(('sm_90a',)))"
du -sh .cubins
