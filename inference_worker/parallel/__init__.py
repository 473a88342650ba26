"""Tensor parallelism of one worker over N processes (`--tensor-parallel-size`): which shard each
rank holds (`shard`), the process groups and collectives (`group`), starting the ranks
(`launcher`), rank 0's side (`leader`), the others' loop (`follower`) and the messages between
them (`step_channel`)."""
