"""`atelier base add DIR`: upload a diffusers pipeline (or some of its folders) as the base jobs
start from, and print the PretrainedModelUri to deploy with (docs/training-jobs.md)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from atelier import bases, client
from atelier.progress import output_flags, progress


def register(commands: argparse._SubParsersAction) -> None:
    """Add this area's subcommands to the `atelier` parser."""
    base = commands.add_parser("base", help="pretrained bases: the parts every job starts from").add_subparsers(
        dest="base_command", required=True)
    add = base.add_parser("add", help="upload a diffusers pipeline folder (or some of its parts) as a base",
                          parents=[output_flags()])
    add.add_argument("dir", type=Path,
                     help="a folder as save_pretrained writes it: vae/, text_encoder/, tokenizer/, scheduler/, unet/ ...")
    add.add_argument("--name", help="the base's name under s3://<models bucket>/bases/ (default: the folder's name)")
    add.set_defaults(func=cmd_base_add)


def cmd_base_add(args: argparse.Namespace) -> int:
    name = args.name or args.dir.resolve().name
    bases.check(args.dir, name)  # before the stack is asked for anything
    bucket = client.stack_outputs(args.stack)["ModelsBucketName"]
    with progress(args.quiet or args.json, transfer=True) as bar:
        task = bar.add_task(f"{name} -> s3://{bucket}/bases/{name}/", total=None)
        added = bases.add(bucket, args.dir, name, on_bytes=lambda n: bar.advance(task, n),
                          on_start=lambda total: bar.update(task, total=total))
    record = added.record
    if args.json:
        print(json.dumps({"uri": added.uri, "parameter": f"PretrainedModelUri={added.uri}", "uploaded": added.uploaded,
                          "components": record["components"], "files": len(record["files"]),
                          "bytes": sum(f["size"] for f in record["files"])}))
        return 0
    size = sum(f["size"] for f in record["files"])
    print(f"base {name}: {', '.join(record['components'])}; {len(record['files'])} files, {size} bytes"
          + ("" if added.uploaded else " (already uploaded)"), file=sys.stderr)
    print(added.uri)
    print(f"PretrainedModelUri={added.uri}")
    return 0
