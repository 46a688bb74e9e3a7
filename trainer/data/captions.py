"""The captions of a channel's image shards, less the manifest's exclusions: what a tokenizer is learned from."""

from collections.abc import Iterator
from pathlib import Path

from contracts.shard_members import CAPTION
from trainer.data.shards import CorruptSample, ShardIndexError, ShardReader, index_shards, load_exclusions


class NoCaptions(ValueError):
    """Latent shards carry token ids, not captions: no tokenizer can be learned from them."""


def read_captions(train_dir: str | Path, manifest: str | Path | None = None,
                  index_dir: str | Path | None = None) -> Iterator[str]:
    """Every readable sample's caption ("" where it has none), shard by shard in the index's order; the
    samples the manifest excludes are never read."""
    index = index_shards(train_dir, 0, 1, load_exclusions(manifest), index_dir)
    if index.latent:
        raise NoCaptions(f"{train_dir} holds latent shards, whose captions are token ids already: give the tokenizer "
                         "they were encoded with (--tokenizer)")
    reader = ShardReader(index)
    for row in range(len(index)):
        try:
            members = reader.read(row)
        except (CorruptSample, ShardIndexError, OSError):
            continue  # the loader reports it; a tokenizer needs no picture
        yield members.get(CAPTION, b"").decode("utf-8", errors="replace")
