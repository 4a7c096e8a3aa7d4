"""`python -m engines.builtin.distributed RANK SIZE PORT PARENT_PID`: a worker rank 0 spawned
(PORT: rank 0's store on loopback; PARENT_PID: rank 0's process, whose end ends the worker)."""

import sys

from engines.builtin.distributed.worker import spawned_main

spawned_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
