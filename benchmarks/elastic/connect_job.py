"""Item 3, job B: new replicas from another launch connect to accept_job.py's port.

usage: python connect_job.py RUNDIR
"""
import os
import sys
import time

import numpy as np
from common import allocate, fao, log, wait_file, write_atomic
from mpi4py import MPI

rundir = sys.argv[1]
world = MPI.COMM_WORLD
rank = world.rank
tag = f"B{rank}"
port = wait_file(os.path.join(rundir, "port"))
time.sleep(float(os.environ.get("JOIN_DELAY", "2")))  # let job A run a while first
world.Barrier()
if rank == 0:
    write_atomic(os.path.join(rundir, "joinreq"), "1")
if os.environ.get("JOIN_NO_CONNECT") == "1":  # a joiner that announced itself, then died
    log(tag, "JOIN_NO_CONNECT: exiting without Connect")
    sys.exit(0)
log(tag, f'connecting to {port!r}')
t0 = time.perf_counter()
try:
    inter = world.Connect(port, MPI.INFO_NULL, 0)
except MPI.Exception as exc:
    log(tag, f"Connect FAILED after {time.perf_counter() - t0:.2f}s: {exc.Get_error_string()}")
    sys.exit(3)
t1 = time.perf_counter()
log(tag, f"connected in {t1 - t0:.4f}s; remote_size={inter.remote_size}")
msg = inter.recv(source=0, tag=1)
inter.send({"reply_from": rank, "latency_s": round(time.time() - msg["t"], 4)}, dest=0, tag=2)
merged = inter.Merge(high=True)
na = inter.remote_size  # the acceptors: merged ranks 0..na-1
jw, jmem = allocate(64, merged)
jmem[:] = 0
jmem[0] = 2000 + merged.rank
jw.Sync()
merged.Barrier()
me = merged.rank
# new rank -> every acceptor a: Accumulate SUM 1 at slot 0, Fetch_and_op +10 at slot 1,
# Put 9000+me at slot 2+(me-na), Get slot 0
gets, olds = [], []
for a in range(na):
    jw.Accumulate(np.array([1], np.int64), a, 0, MPI.SUM)
    jw.Flush(a)
    olds.append(fao(jw, a, 1, 10))
    jw.Put(np.array([9000 + me], np.int64), a, (2 + me - na) * 8)
    jw.Flush(a)
    g = np.zeros(1, np.int64)
    jw.Get(g, a, 0)
    jw.Flush(a)
    gets.append(int(g[0]))
merged.Barrier()
jw.Sync()
mine = jmem[:8].tolist()
merged.Barrier()
ok = mine[2] == 5 * na and all(mine[3 + a] == 7000 + me for a in range(na))
log(tag, f"merged rank {me}: Fetch_and_op olds={olds}, Get acceptors' slot0={gets}, my "
    f"window {mine}: acceptors' Put/Fetch_and_op {'OK' if ok else 'WRONG'}")
if os.environ.get("JOIN_PEER_DIES") == "1":
    log(tag, "JOIN_PEER_DIES: SIGKILL myself")
    import signal
    os.kill(os.getpid(), signal.SIGKILL)
jw.Unlock_all()
jw.Free()
merged.Free()
inter.Disconnect()
log(tag, "disconnected")
