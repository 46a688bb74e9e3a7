"""License terms and takedowns as the manifest builder applies them; older records and manifests."""

from __future__ import annotations

import hashlib
import json

import pytest
from pydantic import ValidationError

from contracts.messages import LeftOut, Manifest
from core.partners.attribution import attribution, chart
from core.partners.licensing import Partner, Revocation, Rules, Terms
from core.provenance import Lineage, SampleSource

SHA_A, SHA_B = "a" * 64, "b" * 64
RESEARCH_ONLY = Partner(partner_id="p", licenses=("open", "research"), rules=(Terms(license="research", uses=("research",)),))
ENDS_2026 = Partner(partner_id="q", licenses=("open",), rules=(Terms(not_after="2026-06-30"),))


def rules(*revocations: Revocation, use: str = "commercial", day: str = "2026-06-30") -> Rules:
    return Rules({"p": RESEARCH_ONLY, "q": ENDS_2026, "r": None}, revocations, use, day)


def test_a_license_for_research_only_is_left_out_of_a_commercial_pipeline() -> None:
    assert rules().reason("p", "research", SHA_A) == "terms of p (research): research use only, not commercial"
    assert rules().reason("p", "open", SHA_A) is None
    assert rules(use="research").reason("p", "research", SHA_A) is None


def test_no_training_after_the_last_day_of_the_terms() -> None:
    assert rules(day="2026-06-30").reason("q", "open", SHA_A) is None  # the day itself is still in
    assert rules(day="2026-07-01").reason("q", "open", SHA_A) == "terms of q (every license): no training after 2026-06-30"
    assert rules(day="2026-07-01").partner_reason("q") is not None  # every sample of q: no reads needed


def test_a_partner_without_terms_or_outside_the_registry_is_not_limited() -> None:
    assert rules().reason("r", "any", SHA_A) is None
    assert not rules().affects("r")


def test_takedowns_cover_a_partner_a_license_or_single_samples() -> None:
    whole = Revocation(partner="p", reason="contract ended", at="2026-05-01T00:00:00+00:00")
    one_license = Revocation(partner="p", license="open", reason="x")
    one_sample = Revocation(partner="p", sha256s=(SHA_A,), reason="artist request")
    assert rules(whole).reason("p", "open", SHA_B) == "revoked 2026-05-01: contract ended"
    assert rules(whole).partner_reason("p") == "revoked 2026-05-01: contract ended"
    assert rules(one_license).reason("p", "open", SHA_B) == "revoked: x"
    assert rules(one_license).partner_reason("p") is None  # which samples: their licenses decide
    assert (rules(one_sample).reason("p", "open", SHA_A), rules(one_sample).reason("p", "open", SHA_B)) \
        == ("revoked: artist request", None)
    assert rules(one_sample).affects("p") and not rules(one_sample).affects("q")


def test_a_takedown_needs_a_reason_and_sample_keys_that_are_sha256s() -> None:
    with pytest.raises(ValidationError):
        Revocation(partner="p", reason="")
    with pytest.raises(ValidationError):
        Revocation(partner="p", sha256s=("not-a-hash",), reason="x")
    assert Revocation(partner="p", sha256s=(SHA_A, SHA_B), reason="x").revocation_id \
        == Revocation(partner="p", sha256s=(SHA_B, SHA_A), reason="y").revocation_id


def test_a_registry_record_from_before_terms_still_reads() -> None:
    old = '{"partner_id": "p", "licenses": ["CC-BY-4.0"], "prefixes": [""], "terms": "", "added_at": "2026-01-01"}'
    assert Partner.model_validate_json(old).rules == ()


def test_a_manifest_from_before_exclusions_reads_with_its_digest_unchanged() -> None:
    old = {"bucket": "b", "prefix": "shards/", "lineage": "main", "sequence": 1,
           "shards": [{"shard_id": "s", "key": "shards/s.tar", "sha256": SHA_A, "samples": 2, "partners": ["p"],
                       "role": "new", "weight": 1.0}]}
    digest = hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    manifest = Manifest.model_validate(old)
    assert (manifest.exclude, manifest.left_out, manifest.digest) == ({}, (), digest)
    excluding = manifest.model_copy(update={"exclude": {"s": (SHA_B,)}, "left_out": (LeftOut(shard_id="s", sha256=SHA_B, reason="r"),)})
    assert excluding.digest != digest and excluding.excluded == 1


def test_attribution_shares_and_its_chart() -> None:
    samples = tuple(SampleSource(sha256=f"{n:064x}", partner="p" if n < 3 else "q", license="open", bucket="u",
                                 key=f"k{n}", version_id="", shards=("s",), manifests=(1,)) for n in range(4))
    lineage = Lineage(job="j", lineage="main", manifest="d", artifact="s3://m/training/j/output/model.tar.gz",
                      manifests=(), samples=samples)
    report = attribution(lineage, {"p": {"open": 5}, "q": {"open": 15}, "unknown": {"unknown": 0}}, "s3://x")
    assert [(s.partner, s.samples, s.draws, s.sample_share, s.draw_share) for s in report.shares] == [
        ("p", 3, 5, 0.75, 0.25), ("q", 1, 15, 0.25, 0.75), ("unknown", 0, 0, 0.0, 0.0)]
    assert chart(report)[:8] == b"\x89PNG\r\n\x1a\n"
