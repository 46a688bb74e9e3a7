"""What the import tests share: webdataset tars written by hand, and img2dataset run for real."""

from __future__ import annotations

import csv
import functools
import http.server
import io
import json
import os
import shutil
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from atelier.catalog import CatalogItem
from tests.support import REPO

# img2dataset lives in its own virtual environment (`make test` builds it: its dependencies,
# opencv, pandas, pyarrow, albumentations and wandb, would also pin webdataset below 0.3 here).
IMG2DATASET = Path(os.environ.get("ATELIER_IMG2DATASET", REPO / ".venv-img2dataset" / "bin" / "img2dataset"))


def webdataset_tar(samples: list[dict[str, bytes]]) -> bytes:
    """A tar as webdataset's TarWriter lays it out: each sample's members under `__key__`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for sample in samples:
            key = sample["__key__"].decode()
            for extension, data in sample.items():
                if extension != "__key__":
                    info = tarfile.TarInfo(f"{key}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def sample_of(key: str, item: CatalogItem, **meta: object) -> dict[str, bytes]:
    extension = item.name.rsplit(".", 1)[1]
    return {"__key__": key.encode(), extension: item.image, "txt": item.sidecar["caption"].encode(),
            "json": json.dumps({"url": f"https://example.org/{key}.{extension}", "key": key, **meta}).encode()}


@contextmanager
def serving(folder: Path) -> Iterator[str]:
    """A loopback HTTP server for `folder`: img2dataset downloads from it, offline."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def run_img2dataset(items: list[CatalogItem], output: Path, per_shard: int, missing: int = 0) -> Path:
    """Serve `items` locally and let img2dataset download them into webdataset shards (with its
    .parquet and _stats.json sidecars); `missing` URLs answer 404."""
    www = output.parent / "www"
    www.mkdir(parents=True, exist_ok=True)
    for n, item in enumerate(items):
        (www / f"{n}.{item.name.rsplit('.', 1)[1]}").write_bytes(item.image)
    with serving(www) as base:
        urls = output.parent / "urls.csv"
        with urls.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["url", "caption"])
            for n, item in enumerate(items):
                writer.writerow([f"{base}/{n}.{item.name.rsplit('.', 1)[1]}", item.sidecar["caption"]])
            for n in range(missing):
                writer.writerow([f"{base}/missing-{n}.png", "never there"])
        env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "WANDB_MODE": "disabled"}
        shutil.rmtree(output, ignore_errors=True)
        subprocess.run([str(IMG2DATASET), "--url_list", str(urls), "--input_format", "csv", "--url_col", "url",
                        "--caption_col", "caption", "--output_format", "webdataset", "--output_folder", str(output),
                        "--processes_count", "1", "--thread_count", "4", "--resize_mode", "no",
                        "--number_sample_per_shard", str(per_shard), "--distributor", "multiprocessing",
                        "--enable_wandb", "False", "--retries", "0", "--timeout", "5"],
                       check=True, env=env, capture_output=True, timeout=120)
    return output
