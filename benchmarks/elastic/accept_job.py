"""Item 3, job A: a running 3-rank job whose rank 0 publishes an MPI port and accepts
replicas from another launch (connect_job.py), while every rank keeps doing RMA on the
job's own window (Win.Allocate + Lock_all(MODE_NOCHECK), like the project's).

usage: python accept_job.py RUNDIR thread|poll|group|none   (A_SECONDS: run length, 45)

thread: rank 0 calls COMM_SELF.Accept in a second thread (MPI_THREAD_MULTIPLE) while its
        main thread keeps doing RMA on the old window.
poll:   rank 0 checks for RUNDIR/joinreq between steps and only then calls Accept (no
        thread; the step blocks for the join).
group:  ranks 0 and 1 ("the shards") accept together over their own communicator.
none:   publish the port, never accept (the joiner's Connect timeout).
The join: p2p over the intercommunicator, Merge, a window over the merged communicator
(acceptor + new ranks only), Put/Get/Accumulate/Fetch_and_op both ways, then free,
Disconnect. Afterwards the old window's counters are checked on every rank.
"""
import os
import sys
import threading
import time

import numpy as np
from common import allocate, fao, log, mpi_name, write_atomic
from mpi4py import MPI

rundir, mode = sys.argv[1], sys.argv[2]
world = MPI.COMM_WORLD
rank, size = world.rank, world.size
tag = f"A{rank}"
comm = world.Dup()
old_win, old_mem = allocate(8 * size, comm)
old_mem[:] = 0
old_win.Sync()
comm.Barrier()
done_file = os.path.join(rundir, "join.done")
result = {}


def join(port: str, acceptors: MPI.Comm) -> None:
    """Accept (collective over `acceptors` only: COMM_SELF, or the shards' communicator),
    talk, merge, window, RMA both ways, tear down."""
    t0 = time.perf_counter()
    inter = acceptors.Accept(port, MPI.INFO_NULL, 0)
    t_acc = time.perf_counter()
    result["accept_s"] = t_acc - t0
    log(tag, f"accepted: remote_size={inter.remote_size}, accept blocked {t_acc - t0:.3f}s")
    t_sent = time.time()
    if acceptors.rank == 0:
        for b in range(inter.remote_size):
            inter.send({"hello": b, "t": t_sent}, dest=b, tag=1)
        replies = [inter.recv(source=b, tag=2) for b in range(inter.remote_size)]
        log(tag, "p2p replies:", replies)
    t1 = time.perf_counter()
    merged = inter.Merge(high=False)
    t2 = time.perf_counter()
    jw, jmem = allocate(64, merged)
    jmem[:] = 0
    jmem[0] = 1000
    jw.Sync()
    t3 = time.perf_counter()
    merged.Barrier()
    na, nb = acceptors.size, inter.remote_size
    me = merged.rank
    log(tag, f"merged size={merged.size} my rank={me}; Merge {t2 - t1:.4f}s, "
        f"Win.Allocate on merged {t3 - t2:.4f}s")
    # acceptor a -> each new rank b: Put 7000+b at slot 3+a, Fetch_and_op +5 at slot 2, Get slot 0
    got = []
    for b in range(na, na + nb):
        jw.Put(np.array([7000 + b], np.int64), b, (3 + me) * 8)
        jw.Flush(b)
        fao(jw, b, 2, 5)
        g = np.zeros(1, np.int64)
        jw.Get(g, b, 0)
        jw.Flush(b)
        got.append(int(g[0]))
    merged.Barrier()   # the new ranks did theirs to every acceptor before this barrier
    jw.Sync()
    mine = jmem[:8].tolist()
    merged.Barrier()
    log(tag, "acceptor's window after the new ranks' ops:", mine, "Get from new ranks:", got)
    ok = (mine[0] == 1000 + nb            # Accumulate SUM 1 from each
          and mine[1] == 10 * nb          # Fetch_and_op SUM 10 from each
          and all(mine[2 + b] == 9000 + na + b for b in range(nb))
          and got == [2000 + b for b in range(na, na + nb)])
    result["join_rma_ok"] = ok
    if os.environ.get("JOIN_PEER_DIES") == "1":
        # job B is SIGKILLed now: free nothing that is collective with it
        log(tag, "JOIN_PEER_DIES: leaving the merged window and the intercomm as they are")
        time.sleep(1.0)
        if os.environ.get("JOIN_PEER_PROBE", "1") == "0":
            return
        t0 = time.perf_counter()
        try:
            fao(jw, na, 2, 1)   # an op on the dead new rank's window
            log(tag, f"op on the dead joined rank returned in "
                f"{(time.perf_counter() - t0) * 1e3:.2f} ms")
        except MPI.Exception as exc:
            log(tag, f"op on the dead joined rank raised: {exc.Get_error_string()}")
        return
    jw.Unlock_all()
    jw.Free()
    merged.Free()
    t4 = time.perf_counter()
    inter.Disconnect()
    result["disconnect_s"] = time.perf_counter() - t4
    log(tag, f"join RMA {'OK' if ok else 'WRONG'}; disconnect {result['disconnect_s']:.4f}s")


# group: ranks 0..SHARDS-1 ("the shards") accept together, collectively over their own
# communicator only (made at start-up); the other ranks ("replicas") never take part
SHARDS = 2 if mode == "group" else 1
shards = world.Split(0 if rank < SHARDS else MPI.UNDEFINED, rank) if mode == "group" else None
acceptors = shards if mode == "group" else MPI.COMM_SELF
port = None
if rank == 0:
    port = MPI.Open_port()
    log(tag, f"{mpi_name()} port: {port!r}")
    write_atomic(os.path.join(rundir, "port"), port)
if mode == "group" and rank < SHARDS:
    port = shards.bcast(port, root=0)

ops = 0
counts = np.zeros(size, np.int64)  # increments this rank did on each target
thread = None
if rank == 0 and mode == "thread":
    log(tag, "thread level:", {MPI.THREAD_MULTIPLE: "MULTIPLE"}.get(MPI.Query_thread(),
                                                                    MPI.Query_thread()))
    thread = threading.Thread(target=join, args=(port, acceptors), daemon=True)
    thread.start()

deadline = time.monotonic() + float(os.environ.get("A_SECONDS", "45"))
joined = False
worst = worst_sleep = 0.0
while time.monotonic() < deadline:
    ts = time.perf_counter()
    # one "step": a Fetch_and_op on every other rank's old window
    for t in range(size):
        if t != rank:
            fao(old_win, t, rank, 1)
            counts[t] += 1
    worst = max(worst, time.perf_counter() - ts)
    ops += 1
    if (rank < SHARDS and mode in ("poll", "group") and not joined
            and os.path.exists(os.path.join(rundir, "joinreq"))):
        join(port, acceptors)
        joined = True
    if rank == 0 and ((thread is not None and not thread.is_alive()) or joined):
        write_atomic(done_file, "1")
        break
    if rank != 0 and os.path.exists(done_file):
        break
    ts = time.perf_counter()
    time.sleep(0.01)
    worst_sleep = max(worst_sleep, time.perf_counter() - ts)

if rank == 0:
    MPI.Close_port(port)
if shards is not None and shards != MPI.COMM_NULL:
    shards.Free()
# the old window: every counter I hold must equal what each origin says it added
allcounts = np.array(comm.allgather(counts))
comm.Barrier()
old_win.Sync()
expect = allcounts[:, rank]
expect[rank] = 0
good = bool(np.array_equal(old_mem, expect))
good = comm.allreduce(good, op=MPI.LAND)
steps = comm.gather((ops, round(worst, 4), round(worst_sleep, 4)), root=0)
if rank == 0:
    log(tag, "per rank (steps, slowest MPI step s, slowest 10 ms sleep s):", steps)
    log(tag, f"old window after the join: {'UNAFFECTED, counters exact' if good else 'WRONG'}"
        f" (steps={ops}); result={result}")
old_win.Unlock_all()
old_win.Free()
comm.Free()
if rank == 0:
    log(tag, "calling MPI_Finalize")
    t0 = time.perf_counter()
MPI.Finalize()
if rank == 0:
    log(tag, f"MPI_Finalize returned in {time.perf_counter() - t0:.3f}s")
