"""``simrun``: start a simpar job on N simulated devices, in the spirit of MindSpore's ``msrun``.

One host, 8 simulated Ascend devices (one MPI rank each)::

    simrun -n 8 -- python -m simpar.train --steps 20
    python -m simpar.launch -n 8 --log-dir out/logs -- python -m simpar.train
    simrun -n 8 --join -- python -m simpar.train        # every rank on the console, "[rank i] ..."

Two hosts of 8 slots each (MPI's own hostfile; see ``launch/hostfile.example``)::

    simrun -n 16 --hostfile launch/hostfile.example -- python -m simpar.train

simrun is a thin layer over ``mpirun``; it is not an MPI rank and never loads MPI itself.

* **mpirun**: ``--mpirun PATH``, else ``$SIMPAR_MPIRUN``, else the one next to ``sys.executable``
  (the venv's bundled MPICH), else the first on ``PATH``. ``mpirun --version`` tells the flavour:
  MPICH Hydra (also Intel MPI, MVAPICH) gets the hostfile as ``-f H``, Open MPI as
  ``--hostfile H`` (and ``--oversubscribe`` when there is no hostfile, since 8 simulated devices
  usually outnumber the cores). ``--mpirun-arg=-v`` passes extra arguments through.
* **logs**: each rank runs under a small wrapper (``python -m simpar.launch --_rank-wrapper``) that
  reads its rank from ``PMI_RANK`` (MPICH) or ``OMPI_COMM_WORLD_RANK`` (Open MPI) and points the
  command's stdout and stderr straight at ``D/rank_{i}.log`` (default ``D = ./logs``). The
  command writes its log itself, so a rank killed mid-line still leaves every byte it wrote.
  The wrapper follows the file to the console for rank 0, or for every rank with ``--join``.
  ``PYTHONUNBUFFERED=1`` is set (unless you set it) so Python ranks' logs are live. The wrapper
  passes SIGINT/SIGTERM/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2 on to the command, reports its exit to
  simrun (a record on mpirun's stdout), and exits with its exit code, or dies by the same
  signal; on Linux the command also dies if the wrapper is killed (``PR_SET_PDEATHSIG``).
* **rank table**: ``D/rank_table.json`` in MindSpore's rank-table format (below), or
  ``--rank-table-file F`` to use an existing one. Every rank gets ``SIMPAR_RANK_TABLE_FILE``
  and ``SIMPAR_LOG_DIR``; :func:`read_rank_table` reads the table back for the cost model.
* **failure**: a Python command (``python ...``) runs as ``python -m mpi4py ...``, mpi4py's
  documented cure for the deadlock where one rank raises and then waits in ``MPI_Finalize`` for
  ranks blocked in a collective: an uncaught exception calls ``MPI_Abort`` and MPICH kills the
  job at once (``--no-abort-on-exception`` turns this off). When a rank exits non-zero and the
  MPI does not end the job, simrun waits ``--grace`` seconds (:data:`FAILURE_GRACE_S`, 5), then
  stops mpirun and kills whatever is left of the job. It then names the failing rank, prints
  the last :data:`TAIL_LINES` lines of its log, and exits with that rank's exit code. (After an
  ``MPI_Abort`` MPICH kills every wrapper at once, so no rank reports; simrun then names the
  rank whose log holds the MPI's abort message, or else a Python traceback.)
* **bad arguments** (``-n 0``, no command, a missing hostfile, fewer hostfile slots than ``-n``, a
  rank table for another device count) print one line naming the flag and the value, exit 2.

The rank table follows MindSpore's ``rank_table_file`` ("rank table Startup" in the MindSpore
tutorials, e.g. ``rank_table_2pcs.json``). Every value is a string, as MindSpore writes them::

    {"version": "1.0", "server_count": "1",
     "server_list": [{"server_id": "vm", "host_nic_ip": "reserve",
                      "device": [{"device_id": "0", "device_ip": "10.0.0.1", "rank_id": "0"},
                                 {"device_id": "1", "device_ip": "10.0.0.2", "rank_id": "1"}]}],
     "status": "completed"}

A server holds at most 8 devices (an Ascend 910 server). A host with more ranks than that is cut
into several simulated servers, named ``host#0``, ``host#1``, ... ``device_ip`` is a placeholder
in 10.0.0.0/8, unique per device: nothing ever connects to it.

The modules, one concept each: :mod:`~simpar.launch.cli` (simrun's and the wrapper's command
lines), :mod:`~simpar.launch.rank_table`, :mod:`~simpar.launch.mpi` (mpirun, its flavour and
hostfile, the ranks' environment), :mod:`~simpar.launch.rank_wrapper` (one rank: its log, its
signals, its exit record) and :mod:`~simpar.launch.supervisor` (running the job, stopping it,
naming the rank that failed).
"""

from simpar.launch.cli import main
from simpar.launch.mpi import LaunchError, MpiFlavor, detect_mpi_flavor, find_mpirun, parse_hostfile
from simpar.launch.rank_table import (
    DEVICES_PER_SERVER,
    RankTable,
    RankTableDevice,
    RankTableServer,
    build_rank_table,
    read_rank_table,
    write_rank_table,
)
from simpar.launch.rank_wrapper import TAIL_LINES
from simpar.launch.supervisor import FAILURE_GRACE_S

__all__ = ["DEVICES_PER_SERVER", "FAILURE_GRACE_S", "TAIL_LINES", "LaunchError", "MpiFlavor",
           "RankTable", "RankTableDevice", "RankTableServer", "build_rank_table",
           "detect_mpi_flavor", "find_mpirun", "main", "parse_hostfile", "read_rank_table",
           "write_rank_table"]
