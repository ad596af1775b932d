# mpiexec -n 2 python scripts/quickstart.py   (this file, one rank per GPU)
import cupy, cuflux

world = cuflux.init()                         # MPI.COMM_WORLD, or any mpi4py communicator
ag = cuflux.AllGather(world, max_rows=4096, cols=8192, dtype="bfloat16", mode="pull")
cupy.cuda.Device(world.device).use()          # this rank's GPU (cuflux never moves yours)
x = cupy.random.standard_normal((1024, 8192), dtype=cupy.float32).astype(ag.dtype.storage)
y = ag(x)                                     # [world.size * 1024, 8192] on every rank
ag.synchronize()                              # raises cuflux.CommTimeoutError if a peer never came
ag.close()                                    # collective; ops are also context managers
