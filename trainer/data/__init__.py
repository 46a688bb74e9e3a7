"""Shards in, batches out: the shard layout, aspect buckets, the run's resolution phases, the loader."""
