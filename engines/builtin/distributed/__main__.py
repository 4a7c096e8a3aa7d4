"""`python -m engines.builtin.distributed RANK SIZE INIT_METHOD`: a worker rank 0 spawned."""

import sys

from engines.builtin.distributed.worker import spawned_main

spawned_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
