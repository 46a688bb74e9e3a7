"""core.partners.licensing: the partner registry and which license an upload is used under."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from atelier.local.provision import Provisioned
from core import aws
from core.errors import RejectedUpload
from core.partners.licensing import Partner, get_partner, license_for, list_partners, put_partner

ONE_LICENSE = Partner(partner_id="partner-a", licenses=("CC-BY-4.0",))
TWO_LICENSES = Partner(partner_id="partner-a", licenses=("CC-BY-4.0", "partner-a-commercial"))
CATALOG_ONLY = Partner(partner_id="partner-a", licenses=("CC-BY-4.0",), prefixes=("catalog/", "press/2026/"))


def unlicensed(partner: Partner | None, key: str, sidecar_license: str = "") -> str:
    """The detail of the `unlicensed` rejection (failing if the reason is another one)."""
    with pytest.raises(RejectedUpload) as raised:
        license_for(partner, "partner-a", key, sidecar_license)
    assert raised.value.reason == "unlicensed"
    return raised.value.detail


# --- license_for ----------------------------------------------------------------------------------

def test_unknown_partner_is_unlicensed() -> None:
    assert unlicensed(None, "partner-a/x.jpg") == "partner 'partner-a' is not in the registry"


def test_partner_with_one_license_grants_it_without_a_sidecar_license() -> None:
    assert license_for(ONE_LICENSE, "partner-a", "partner-a/x.jpg", "") == "CC-BY-4.0"


def test_partner_with_several_licenses_needs_a_sidecar_license() -> None:
    assert "holds several" in unlicensed(TWO_LICENSES, "partner-a/x.jpg")


@pytest.mark.parametrize("sidecar_license", ["CC-BY-4.0", "partner-a-commercial"])
def test_sidecar_license_the_partner_holds_is_used(sidecar_license: str) -> None:
    assert license_for(TWO_LICENSES, "partner-a", "partner-a/x.jpg", sidecar_license) == sidecar_license


@pytest.mark.parametrize("sidecar_license", ["CC-BY-NC-4.0", "cc-by-4.0", "partner-b-commercial"])
def test_sidecar_license_the_partner_does_not_hold_is_unlicensed(sidecar_license: str) -> None:
    # even when the partner holds exactly one license: the sidecar says it is not that one
    assert unlicensed(ONE_LICENSE, "partner-a/x.jpg", sidecar_license) \
        == f"license {sidecar_license!r} is not one partner-a holds"


def test_sidecar_license_is_compared_without_surrounding_whitespace() -> None:
    # Sidecar captions and sources are stripped; a hand-written "CC-BY-4.0 " is the same license.
    assert license_for(TWO_LICENSES, "partner-a", "partner-a/x.jpg", "\tCC-BY-4.0 ") == "CC-BY-4.0"


@pytest.mark.parametrize("key", [
    "partner-a/catalog/x.jpg",
    "partner-a/catalog/2026/summer sale/Ölgemälde.jpg",
    "partner-a/press/2026/x.png",
])
def test_key_under_a_partner_prefix_is_licensed(key: str) -> None:
    assert license_for(CATALOG_ONLY, "partner-a", key, "") == "CC-BY-4.0"


@pytest.mark.parametrize("key", [
    "partner-a/x.jpg",
    "partner-a/catalog-old/x.jpg",
    "partner-a/Catalog/x.jpg",
    "partner-a/press/2025/x.jpg",
    "partner-a/private/catalog/x.jpg",
])
def test_key_outside_the_partner_prefixes_is_unlicensed(key: str) -> None:
    assert "under none of the partner's prefixes" in unlicensed(CATALOG_ONLY, key)


def test_default_prefix_licenses_every_key_of_the_partner() -> None:
    assert license_for(ONE_LICENSE, "partner-a", "partner-a/any/depth/x.jpg", "") == "CC-BY-4.0"


def test_prefix_is_checked_before_the_sidecar_license() -> None:
    assert "under none of the partner's prefixes" in unlicensed(CATALOG_ONLY, "partner-a/x.jpg", "CC-BY-4.0")


def test_partner_without_licenses_is_invalid() -> None:
    with pytest.raises(ValidationError):
        Partner(partner_id="partner-a", licenses=())


# --- the registry in the pipeline table -----------------------------------------------------------

def test_registry_round_trip(stack: Provisioned) -> None:
    table = stack.outputs["PipelineTableName"]
    partner = Partner(partner_id="partner-b", licenses=("CC-BY-4.0", "partner-b-commercial"),
                      prefixes=("catalog/",), terms="attribution in the model card")

    stored = put_partner(table, partner)

    assert stored.added_at  # stamped when first put
    assert stored.model_copy(update={"added_at": ""}) == partner
    assert (get_partner(table, "partner-b"), get_partner(table, "partner-z")) == (stored, None)


def test_registry_lists_partners_by_id_and_nothing_else(stack: Provisioned) -> None:
    table = stack.outputs["PipelineTableName"]
    for partner_id in ("partner-c", "partner-a", "partner-b"):
        put_partner(table, Partner(partner_id=partner_id, licenses=("CC-BY-4.0",), added_at="2026-11-29T12:00:00+00:00"))
    aws.put_item(table, {"pk": "SAMPLE#" + "0" * 64, "record": "{}"})  # other items share the table

    listed = list_partners(table)

    assert [p.partner_id for p in listed] == ["partner-a", "partner-b", "partner-c"]
    assert {p.added_at for p in listed} == {"2026-11-29T12:00:00+00:00"}  # a given time is kept


def test_putting_a_partner_again_replaces_its_terms(stack: Provisioned) -> None:
    table = stack.outputs["PipelineTableName"]
    put_partner(table, ONE_LICENSE)

    put_partner(table, TWO_LICENSES)

    assert [p.licenses for p in list_partners(table)] == [("CC-BY-4.0", "partner-a-commercial")]
