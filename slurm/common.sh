# shellcheck shell=bash
# Sourced by every sbatch script of this folder: signals, requeue and exit status, written
# once. A script sources it (it finds this file as its "Find slurm/common.sh" block says),
# then starts its launcher in the background and calls `finish PID`. It reads
# MAX_REQUEUES (50 if unset) and SLURM's variables; it sets DISTBELIEF_OUTCOME_FILE and
# the traps. docs/cluster.md, "Time limits, preemption, requeue", explains it.
#
# --signal=B:USR1 reaches only this shell: `forward` passes it on to the launcher, which
# passes it to every rank; the run finishes its step, writes a checkpoint and exits 0.
# SIGTERM (time limit, preemption, scancel) reaches the ranks from SLURM as well, and is
# passed on the same way for when it reaches only this shell. Always as SIGUSR1: the run
# treats SIGUSR1 and SIGTERM alike, and srun answers a SIGTERM of its own by killing the
# ranks (SIGKILL, no checkpoint: seen with SLURM 22.05). Then `finish` requeues
# the job if the time limit was near (USR1), and exits with a status that says what
# happened: 0 finished or requeued; the launcher's status if the run failed (never
# requeued); 1 stopped by USR1 but not requeued; 143 stopped by SIGTERM.
# A Downpour run goes on without a replica that dies, but the launcher then ends with the
# dead rank's status (137 for kill -9): the run says how it really ended in this file.
export DISTBELIEF_OUTCOME_FILE="${SLURM_SUBMIT_DIR:-$PWD}/.distbelief-outcome-${SLURM_JOB_ID:-$$}"
rm -f "$DISTBELIEF_OUTCOME_FILE"
launcher=""
watcher=""    # the stuck-launcher watch, if one runs beside the launcher
signalled=""  # the last signal received
received=0    # how many
# shellcheck disable=SC2317  # called from the traps
forward() {
    signalled=$1
    received=$((received + 1))
    echo "distbelief-slurm: SIG$1 received, asking the run to checkpoint and stop"
    if [ -n "$launcher" ]; then kill -s USR1 "$launcher" 2>/dev/null; fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

finish() {
    launcher=$1
    # A signal that came while the launcher was starting.
    if [ -n "$signalled" ]; then kill -s USR1 "$launcher" 2>/dev/null; fi
    # A trapped signal makes `wait` return at once (status > 128) while the launcher
    # still runs: wait again until it has really ended. A later `wait` for a finished
    # child still returns its status; 127 means it was collected already.
    local status=0 rc before
    while :; do
        before=$received
        wait "$launcher"
        rc=$?
        [ "$rc" -eq 127 ] && break
        status=$rc
        [ "$received" -eq "$before" ] && break
    done
    # The run has ended: nothing to pass signals on to (the requeue below sends one).
    trap '' USR1 TERM
    if [ -n "$watcher" ]; then kill "$watcher" 2>/dev/null; fi

    if [ "$status" -ne 0 ] && [ -s "$DISTBELIEF_OUTCOME_FILE" ]; then
        echo "distbelief-slurm: a rank was lost (launcher status $status), but the run" \
             "ended cleanly: $(cat "$DISTBELIEF_OUTCOME_FILE")" >&2
        status=0
    fi
    rm -f "$DISTBELIEF_OUTCOME_FILE"
    if [ "$status" -ne 0 ]; then
        echo "distbelief-slurm: the run failed (exit status $status); not requeuing" >&2
        exit "$status"
    fi
    case $signalled in
    "")
        echo "distbelief-slurm: the run finished"
        exit 0
        ;;
    USR1)
        # The time limit is near and the run has checkpointed: come back and resume.
        local restarts=${SLURM_RESTART_COUNT:-0}
        if [ -z "${SLURM_JOB_ID:-}" ]; then
            echo "distbelief-slurm: not under SLURM, cannot requeue: run the same" \
                 "command again to resume" >&2
            exit 1
        fi
        if [ "$restarts" -ge "${MAX_REQUEUES:-50}" ]; then
            echo "distbelief-slurm: requeued $restarts times already (MAX_REQUEUES):" \
                 "stopping here; submit the same command again to resume" >&2
            exit 1
        fi
        # Said first: the requeue ends this script.
        echo "distbelief-slurm: checkpoint written; requeuing job $SLURM_JOB_ID to resume"
        if ! scontrol requeue "$SLURM_JOB_ID"; then
            echo "distbelief-slurm: scontrol requeue failed; submit the same command" \
                 "again to resume" >&2
            exit 1
        fi
        exit 0
        ;;
    *)
        # SIGTERM: preemption (SLURM requeues the job itself if the partition says so),
        # scancel, or the time limit without the --signal margin. The checkpoint is
        # written; the run did not finish.
        echo "distbelief-slurm: stopped by SIG$signalled after a checkpoint; not" \
             "requeuing" >&2
        exit 143
        ;;
    esac
}
