#!/usr/bin/env bash
# One host, 8 simulated Ascend devices: 8 MPI ranks of python -m simpar.train.
#
#   bash launch/run_8p.sh [train args...]      e.g.  bash launch/run_8p.sh --steps 20
#
# Rank i writes logs/rank_i.log; rank 0 is also shown on the console (add --join after
# "simrun" below to see every rank, prefixed by [rank i]). logs/rank_table.json describes the
# simulated server. The first failing rank ends the job; simrun prints the end of its log.
set -euo pipefail
cd "$(dirname "$0")/.."

if command -v simrun >/dev/null 2>&1; then
    SIMRUN=(simrun)
else  # not installed as a console script (e.g. no `pip install -e .` yet)
    SIMRUN=("${PYTHON:-python}" -m simpar.launch)
fi

exec "${SIMRUN[@]}" -n 8 --log-dir logs -- python -m simpar.train "$@"
