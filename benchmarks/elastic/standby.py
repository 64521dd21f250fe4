"""Item 4: a standby for a lost shard. One window over the whole world (Win.Allocate over a
duplicate of COMM_WORLD, disp unit 1, Lock_all(MODE_NOCHECK) held for the window's life,
as src/distbelief/ps/rma_windows.py does); rank 1 (a shard) copies its slice into rank 2
(its standby) by Put + Flush at an interval, then SIGKILLs itself mid-run.

ranks: 0 shard 0, 1 shard 1 (the victim), 2 standby of shard 1, 3.. replicas.

usage: python standby.py kill [SLICE_BYTES] [INTERVAL_S]
       python standby.py rate [SLICE_BYTES] [REPEATS]      (no kill: Put rate 1 -> 2)

kill: survivors keep doing RMA on the old window to ranks 0 and 2 after the death (each
op timed); then build a communicator without the dead rank (Comm.Create_group over the
survivors' group, and ULFM's Comm.Shrink where the MPI has it), allocate a new window on
it, check the standby's copy; last, one rank tries an op on the dead target (under a
5 s faulthandler exit). Survivors end without MPI_Finalize (it would wait for the dead
rank), unlinking the /dev/shm files they map, as the project's guardian does.
"""
import faulthandler
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
from common import allocate, fao, log, mpi_name
from mpi4py import MPI

HEADER = 64 * ((MPI.COMM_WORLD.Get_size() + 1 + 7) // 8)  # int64 slots: [r] counters from
# origin r; [VERSION] = [world size]: the copy's version
VERSION = MPI.COMM_WORLD.Get_size()
mode = sys.argv[1]
slice_bytes = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
world = MPI.COMM_WORLD
rank, size = world.rank, world.size
tag = f"r{rank}"
faulthandler.enable()
# Hydra (-disable-auto-cleanup) sends SIGUSR1 to every rank when one dies: note it.
notices = []
signal.signal(signal.SIGUSR1, lambda *_: notices.append(time.monotonic()))
comm = world.Dup()
comm.Set_errhandler(MPI.ERRORS_RETURN)
pids = comm.allgather(os.getpid())
nbytes = HEADER + (slice_bytes if rank in (0, 1, 2) else 0)
win, mem = allocate(nbytes, comm)
win.Set_errhandler(MPI.ERRORS_RETURN)
raw = np.frombuffer(win.tomemory(), dtype=np.uint8)
mem[:HEADER // 8] = 0
win.Sync()
comm.Barrier()
nfloat = slice_bytes // 4


def leave(status: int) -> None:
    """End without MPI_Finalize; unlink the /dev/shm files this process maps."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f
                     if len(line.split(None, 5)) == 6 and "/dev/shm/" in line}
        for p in paths:
            p = p.replace(" (deleted)", "")
            try:
                os.unlink(p)
            except OSError:
                pass
    finally:
        sys.stdout.flush()
        os._exit(status)


def alive(r: int) -> bool:
    try:
        os.kill(pids[r], 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pids[r]}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


if mode == "rate":
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    if rank == 1:
        src = np.full(nfloat, 1.5, np.float32)
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            win.Put(src, 2, HEADER)
            win.Flush(2)
            rates.append(slice_bytes / (time.perf_counter() - t0))
        log(tag, f"{mpi_name()} Put+Flush of {slice_bytes / 2**20:.0f} MiB to the standby: "
            f"{', '.join(f'{r / 1e9:.2f}' for r in rates)} GB/s (median "
            f"{sorted(rates)[len(rates) // 2] / 1e9:.2f} GB/s)")
    comm.Barrier()
    if rank == 2:
        ok = np.all(np.frombuffer(raw[HEADER:HEADER + slice_bytes], np.float32) == 1.5)
        log(tag, f"standby's copy {'complete' if ok else 'WRONG'}")
    comm.Barrier()
    win.Unlock_all()
    win.Free()
    comm.Free()
    # hydra (-disable-auto-cleanup) SIGUSR1s the others as the first rank ends: ignore it
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    sys.exit(0)

# ---- kill mode ----
interval = float(sys.argv[3]) if len(sys.argv) > 3 else 0.2
KILL_AFTER = 2.0 + random.Random(os.getpid()).uniform(0, 0.5)
AFTER = 2.0  # seconds of ops after the death is seen
start = time.monotonic()

if rank == 1:
    v = 0
    last_copy = time.monotonic()
    src = np.empty(nfloat, np.float32)
    copy_s = []
    while True:
        v += 1  # "an update applied": the slice becomes all v
        src[:] = v
        now = time.monotonic()
        if now - last_copy >= interval:
            t0 = time.perf_counter()
            win.Put(src, 2, HEADER)
            win.Flush(2)
            fao(win, 2, VERSION, v, MPI.REPLACE)  # the copy's version, after its data
            copy_s.append(time.perf_counter() - t0)
            last_copy = now
            if len(copy_s) % 5 == 1:
                log(tag, f"copy #{len(copy_s)} version {v}: {slice_bytes / copy_s[-1] / 1e9:.2f}"
                    " GB/s")
        # the record of what exists only here: updates made
        with open(os.environ["STANDBY_LOG"], "w") as f:
            f.write(f"{v}\n")
        if now - start > KILL_AFTER:
            log(tag, f"SIGKILL myself at version {v} (copies made: {len(copy_s)})")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.02)

# survivors: ops on the old window until rank 1 is seen dead, then AFTER more seconds
targets = [t for t in (0, 1, 2) if t != rank]
if os.environ.get("VICTIM_OPS", "1") == "0":  # never target the victim: live targets only
    targets = [t for t in targets if t != 1]
worst = {t: 0.0 for t in targets}
done = {t: 0 for t in targets}
errors = []
seen_dead = None
get = np.zeros(1024, np.uint8)
faulthandler.dump_traceback_later(30, exit=True)  # a hang in an op is reported
while True:
    if seen_dead is None and not alive(1):
        seen_dead = time.monotonic()
        log(tag, f"rank 1 is dead (/proc), hydra SIGUSR1 notices so far: {len(notices)}")
        if 1 in targets:
            targets.remove(1)
    if seen_dead is not None and time.monotonic() - seen_dead > AFTER:
        break
    if time.monotonic() - start > 20:
        log(tag, "rank 1 never died?")
        break
    for t in targets:
        t0 = time.perf_counter()
        try:
            fao(win, t, rank, 1)
            win.Get(get, t, HEADER)
            win.Flush(t)
        except MPI.Exception as exc:
            errors.append(f"op to {t}: {exc.Get_error_string()}")
            continue
        worst[t] = max(worst[t], time.perf_counter() - t0)
        done[t] += 1
    time.sleep(0.01)
faulthandler.cancel_dump_traceback_later()
log(tag, f"old window after the death: ops completed per target {done}, slowest op s "
    f"{ {t: round(w, 4) for t, w in worst.items()} }, errors {errors[:3]}")

# a communicator without the dead rank: Create_group, collective over the survivors only
faulthandler.dump_traceback_later(20, exit=True)
survivors = [r for r in range(size) if r != 1]
group = comm.Get_group().Incl(survivors)
t0 = time.perf_counter()
try:
    new = comm.Create_group(group, tag=46)
except MPI.Exception as exc:
    log(tag, f"Create_group FAILED: {exc.Get_error_string()}")
    leave(3)
t_group = time.perf_counter() - t0
t0 = time.perf_counter()
new_win, new_mem = allocate(HEADER + (slice_bytes if rank in (0, 2) else 0), new)
t_win = time.perf_counter() - t0
log(tag, f"Create_group over {survivors}: {t_group * 1e3:.2f} ms; Win.Allocate + Lock_all "
    f"on it: {t_win * 1e3:.2f} ms (new rank {new.rank} of {new.size})")
if rank == 2:
    copy = np.frombuffer(raw[HEADER:HEADER + slice_bytes], np.float32)
    version = int(mem[VERSION])
    made = int(Path(os.environ["STANDBY_LOG"]).read_text())
    uniform = bool(np.all(copy == copy[0]))
    log(tag, f"standby's copy: version {version}, all elements equal: {uniform} "
        f"(value {copy[0]:.0f}); the dead shard had made {made}: lost {made - version} "
        f"updates since the last copy")
    # take over: the slice goes into the new window
    np.frombuffer(new_win.tomemory(), np.float32)[HEADER // 4:] = copy
    new_win.Sync()
new.Barrier()
if rank >= 3:
    standby = new.Get_group().Get_size() and survivors.index(2)
    g = np.zeros(4, np.float32)
    new_win.Get(g, standby, HEADER)
    new_win.Flush(standby)
    old = fao(new_win, standby, 0, 1)
    log(tag, f"new window: Get from the standby (new rank {standby}) -> {g.tolist()}, "
        f"Fetch_and_op ok (old {old})")
new.Barrier()
new_win.Unlock_all()
new_win.Free()
new.Barrier()
faulthandler.cancel_dump_traceback_later()


def bounded(what: str, call, limit: float = 5.0) -> None:
    """call() in a thread; report its result, its error or that it hung past `limit`."""
    box = {}

    def run():
        t0 = time.perf_counter()
        try:
            box["ok"] = call()
        except Exception as exc:  # noqa: BLE001 - reported
            box["err"] = (exc.Get_error_string() if isinstance(exc, MPI.Exception)
                          else f"{type(exc).__name__}: {exc}")
        box["s"] = time.perf_counter() - t0
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    if th.is_alive():
        log(tag, f"{what}: HUNG (no return after {limit:.0f} s)")
    elif "err" in box:
        log(tag, f"{what}: raised after {box['s'] * 1e3:.1f} ms: {box['err']}")
    else:
        log(tag, f"{what}: returned in {box['s'] * 1e3:.2f} ms -> {box['ok']}")


if rank in (2, 3):  # an op on the dead target (under simulated nodes: 2 is off its node)
    bounded("Fetch_and_op + Flush on the DEAD rank 1", lambda: fao(win, 1, rank, 1))
    bounded("Put + Flush to the DEAD rank 1",
            lambda: (win.Put(np.zeros(8, np.uint8), 1, HEADER), win.Flush(1)) and "ok")
if hasattr(comm, "Shrink") and os.environ.get("SHRINK", "1") == "main":
    # in the main thread, under a 10 s faulthandler exit
    faulthandler.dump_traceback_later(10, exit=True)
    t0 = time.perf_counter()
    try:
        size_after = comm.Shrink().size
        log(tag, f"Comm.Shrink (ULFM, main thread): size {size_after} in "
            f"{(time.perf_counter() - t0) * 1e3:.2f} ms")
    except MPI.Exception as exc:
        log(tag, f"Comm.Shrink (ULFM, main thread) raised: {exc.Get_error_string()}")
    faulthandler.cancel_dump_traceback_later()
elif hasattr(comm, "Shrink") and os.environ.get("SHRINK", "1") == "1":
    bounded("Comm.Shrink (ULFM) over the old communicator", lambda: f"size {comm.Shrink().size}")
log(tag, f"done; hydra SIGUSR1 notices: {len(notices)}")
leave(0)
