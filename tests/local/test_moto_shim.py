"""atelier.local.moto_shim: every patch of moto's internals is pinned to the moto it was written for, and an
upgrade that changes what a patch replaces or relies on fails here before the patch runs on new code."""

from __future__ import annotations

import re
from pathlib import Path

import moto
import pytest

from atelier.local import moto_shim

REPO = Path(__file__).resolve().parents[2]
TARGETS = sorted((target, fingerprint) for patch in moto_shim.PATCHES for target, fingerprint in patch.targets.items())


def test_the_installed_moto_is_the_one_the_shim_was_written_for_and_constraints_pin_it() -> None:
    pinned = re.search(r"^moto==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert moto.__version__ == moto_shim.MOTO_VERSION == (pinned and pinned.group(1))


@pytest.mark.parametrize(("target", "fingerprint"), TARGETS, ids=[target for target, _ in TARGETS])
def test_moto_s_code_under_each_patch_is_what_the_patch_was_written_against(target: str, fingerprint: str) -> None:
    # on a failure: read the patch (and docs/moto-upstream.md) against moto's new code, then record the new digest
    assert moto_shim.source_fingerprint(target) == fingerprint


def test_a_fingerprint_follows_the_source_and_a_missing_name_is_an_error() -> None:
    assert moto_shim.source_fingerprint("moto.sqs.models:Queue.messages") != moto_shim.source_fingerprint(
        "moto.sqs.models:Message.visible")
    with pytest.raises(LookupError, match="no Queue.not_a_method"):
        moto_shim.source_fingerprint("moto.sqs.models:Queue.not_a_method")


def test_every_patch_has_upstream_issue_text_in_the_docs() -> None:
    upstream = (REPO / "docs" / "moto-upstream.md").read_text()
    for patch in moto_shim.PATCHES:
        assert f"## {patch.name}" in upstream, patch.name
