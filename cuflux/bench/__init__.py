"""Benchmarks: `python -m cuflux.bench <op>` (under mpiexec for several ranks)."""
