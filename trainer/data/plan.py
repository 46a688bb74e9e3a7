"""Which samples make each micro-batch: a pure function of (seed, rank, step, micro-batch) (BRIA's strategy,
with nothing to save for resuming).

Per phase and epoch, a process shuffles its samples with a generator seeded by (seed, rank, phase,
epoch), groups them by aspect bucket (trainer/data/buckets.py), cuts each bucket into batches (the
last one filled up from the start of its bucket) and shuffles the batches. Optimizer step s and
micro-batch m map to a position in that sequence, so a batch is a pure function of (seed, step,
rank): a resumed job reads exactly what the uninterrupted job would have, with no loader state, and
a job resumed on another number of GPUs simply draws its own sequence.

Given the samples' keys, the shuffle runs over them in key order, not in the order the shards hold
them: which shard a sample was packed into, and where, depends on when its upload arrived, so without
the keys the same samples and seed would train differently from one packing to the next.
"""

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from trainer.data.buckets import assign_buckets, bucket_sizes, check_resolution
from trainer.data.phases import RunPlan


def buckets_of(aspects: np.ndarray, resolution: int, size_multiple: int, aspect_buckets: bool) -> tuple[list[tuple[int, int]], np.ndarray]:
    """(bucket sizes at `resolution`, each sample's bucket); one centred square without aspect buckets."""
    if not aspect_buckets:
        check_resolution(resolution, size_multiple)
        return [(resolution, resolution)], np.zeros(len(aspects), dtype=np.int64)
    sizes = bucket_sizes(resolution, size_multiple)
    return sizes, assign_buckets(aspects, sizes)


@dataclass(frozen=True)
class Slot:
    """Where one micro-batch sits in its process's stream."""

    phase: int
    epoch: int
    index: int  # the batch's position within the epoch
    bucket: tuple[int, int]  # (width, height)
    samples: np.ndarray  # row numbers in the ShardIndex
    bucket_members: np.ndarray  # every row of this bucket (replacements come from here)


class BatchPlan:
    """Which samples make each micro-batch: a pure function of (seed, rank, step, micro-batch)."""

    def __init__(self, aspects: np.ndarray, plan: RunPlan, seed: int, rank: int, accumulation: int,
                 size_multiple: int, aspect_buckets: bool, keys: np.ndarray | None = None):
        self.aspects, self.plan, self.seed, self.rank = aspects, plan, seed, rank
        # rows in key order: the shuffle's input does not depend on how the samples were packed
        self.canonical = np.argsort(keys, kind="stable") if keys is not None else np.arange(len(aspects))
        self.accumulation, self.size_multiple, self.aspect_buckets = accumulation, size_multiple, aspect_buckets

    @lru_cache(maxsize=8)
    def phase_buckets(self, phase: int) -> tuple[list[tuple[int, int]], np.ndarray]:
        """The phase's bucket sizes and each sample's bucket."""
        return buckets_of(self.aspects, self.plan.phases[phase].resolution, self.size_multiple, self.aspect_buckets)

    @lru_cache(maxsize=4)
    def epoch_batches(self, phase: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(samples [batches, batch size], bucket of each batch) for one pass over this process's samples."""
        _, assignment = self.phase_buckets(phase)
        batch_size = self.plan.phases[phase].batch_size
        rng = np.random.default_rng([self.seed, self.rank, phase, epoch, 0])
        order = self.canonical[rng.permutation(len(self.aspects))]
        batches, buckets = [], []
        for bucket in np.unique(assignment):
            members = order[assignment[order] == bucket]
            filled = np.resize(members, -(-len(members) // batch_size) * batch_size)  # repeats from the start
            batches.append(filled.reshape(-1, batch_size))
            buckets += [bucket] * (len(filled) // batch_size)
        batches, buckets = np.concatenate(batches), np.array(buckets)
        shuffle = rng.permutation(len(batches))
        return batches[shuffle], buckets[shuffle]

    @lru_cache(maxsize=8)
    def batches_per_epoch(self, phase: int) -> int:
        _, assignment = self.phase_buckets(phase)
        batch_size = self.plan.phases[phase].batch_size
        return int(sum(-(-count // batch_size) for count in np.bincount(assignment) if count))

    def slot(self, step: int, micro: int) -> Slot:
        phase = self.plan.phase_index(step)
        position = (step - self.plan.phases[phase].first_step) * self.accumulation + micro
        epoch, index = divmod(position, self.batches_per_epoch(phase))
        batches, buckets = self.epoch_batches(phase, epoch)
        sizes, assignment = self.phase_buckets(phase)
        bucket = int(buckets[index])
        return Slot(phase, epoch, index, sizes[bucket], batches[index], np.flatnonzero(assignment == bucket))
