"""The aspect buckets' sizes for a phase: pure arithmetic on its resolution and the model's size multiple, shared by
the trainer (trainer/data/buckets.py, which assigns images to them) and the pipeline, which checks a stage's widest
bucket against an SD3 preset's position table before any job starts (contracts.model_presets)."""

from __future__ import annotations

MAX_ASPECT = 2.0  # wider than 2:1 keeps too few pixels on the short side at 256 px


def check_resolution(resolution: int, multiple: int) -> int:
    """`resolution`, if a multiple of the model's size multiple (`Models.size_multiple`; the pipeline's settings
    check a phase against each preset's, functions/contracts/model_presets.py)."""
    if resolution % multiple:
        raise ValueError(f"resolution {resolution} is not a multiple of {multiple}, the model's size multiple "
                         "(its VAE's downsampling times its denoiser's)")
    return resolution


def bucket_sizes(resolution: int, multiple: int) -> list[tuple[int, int]]:
    """(width, height) buckets for a phase, sorted by aspect ratio; always includes the square."""
    area = check_resolution(resolution, multiple) ** 2
    sizes = {(resolution, resolution)}
    for width in range(multiple, int(resolution * MAX_ASPECT) + 1, multiple):
        height = (area // width) // multiple * multiple
        if height >= multiple and 1 / MAX_ASPECT <= width / height <= MAX_ASPECT:
            sizes.add((width, height))
    return sorted(sizes, key=lambda size: size[0] / size[1])


def widest_side(resolutions: list[int], multiple: int, aspect_buckets: bool) -> int:
    """The longest side a bucket of these phases can have (about sqrt(MAX_ASPECT) x the largest resolution)."""
    return max(max(max(size) for size in bucket_sizes(resolution, multiple)) if aspect_buckets else resolution
               for resolution in resolutions)


def bucket_shapes(resolutions: list[int], multiple: int, aspect_buckets: bool) -> int:
    """How many (width, height) shapes these phases' batches take: one graph each for a compiled step."""
    return sum(len(bucket_sizes(resolution, multiple)) if aspect_buckets else 1 for resolution in resolutions)
