"""Aspect-ratio buckets: batch images of similar shape at about the phase's pixel count, cropped little.

For a phase at resolution R the buckets are the (width, height) pairs, both multiples of the model's
size multiple, whose area is at most R*R and whose aspect ratio is within MAX_ASPECT either way
(for each width, the largest such height). An image goes to the bucket nearest its aspect ratio
(in log space, so 2:1 and 1:2 are equally far from 1:1); it is scaled to cover the bucket and
cropped to it, and the crop's offset is what SDXL's crop conditioning is told.
"""

import math

import numpy as np

from contracts.bucket_sizes import MAX_ASPECT, bucket_shapes, bucket_sizes, check_resolution, widest_side  # noqa: F401 (the trainer's names)


def assign_buckets(aspects: np.ndarray, sizes: list[tuple[int, int]]) -> np.ndarray:
    """The index of the bucket nearest each aspect ratio (width / height)."""
    bucket_logs = np.log([width / height for width, height in sizes])
    distance = np.abs(np.log(np.asarray(aspects, dtype=np.float64))[:, None] - bucket_logs[None, :])
    return distance.argmin(axis=1)


def cover_and_crop(width: int, height: int, target: tuple[int, int], offset: tuple[float, float]) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized width, height), (crop left, top)) to fill `target` from an image, no stretching.

    `offset` in [0, 1]^2 places the crop along the spare width and height: (0.5, 0.5) is the centre.
    """
    target_width, target_height = target
    scale = max(target_width / width, target_height / height)
    resized = (max(target_width, math.ceil(width * scale - 1e-6)), max(target_height, math.ceil(height * scale - 1e-6)))
    left = round((resized[0] - target_width) * offset[0])
    top = round((resized[1] - target_height) * offset[1])
    return resized, (left, top)
