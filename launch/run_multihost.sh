#!/usr/bin/env bash
# Several hosts, 8 simulated Ascend devices each, placed by MPI's own hostfile.
#
#   HOSTFILE=launch/hostfile.example NPROC=16 bash launch/run_multihost.sh [train args...]
#
# What MPI needs, and so what this needs, on every host in the hostfile:
#   * the same code and the same venv at the same path as here (a shared file system, or an
#     identical install), since each host runs "$PWD/.venv/bin/python -m simpar.launch ...";
#   * the same MPI (the bundled mpich wheel comes with the venv);
#   * passwordless ssh from this host (try: ssh node-b true), and host names that resolve.
# Each host writes the logs of its own ranks to $LOG_DIR there (on a shared file system they
# all land in one directory). The rank table is written here, before the job starts, from the
# hostfile's slot counts: ranks fill node-a's 8 slots, then node-b's.
set -euo pipefail
cd "$(dirname "$0")/.."

HOSTFILE=${HOSTFILE:-launch/hostfile.example}
NPROC=${NPROC:-16}
LOG_DIR=${LOG_DIR:-logs}

if command -v simrun >/dev/null 2>&1; then
    SIMRUN=(simrun)
else
    SIMRUN=("${PYTHON:-python}" -m simpar.launch)
fi

exec "${SIMRUN[@]}" -n "$NPROC" --hostfile "$HOSTFILE" --log-dir "$LOG_DIR" \
    -- python -m simpar.train "$@"
