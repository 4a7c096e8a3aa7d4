"""Tensor parallelism on torch.distributed: what each rank keeps (shard.py), the collectives
the model calls and rank 0's messages (group.py), starting and ending the ranks (launch.py),
and the loop of a rank other than 0 (worker.py). docs/parallelism.md."""
