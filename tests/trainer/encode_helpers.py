"""What the encode job's tests read latent shards with."""

import tarfile
from pathlib import Path


def members_of(path) -> dict[str, bytes]:
    """A tar's members, name -> bytes, in order."""
    with tarfile.open(path) as tar:
        return {member.name: tar.extractfile(member).read() for member in tar.getmembers()}


def files_under(folder) -> dict[str, bytes]:
    """Every file under `folder`, relative path -> bytes."""
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(Path(folder).rglob("*")) if path.is_file()}
