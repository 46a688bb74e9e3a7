"""The partner registry and the license decision: no upload is a sample without a license."""

from __future__ import annotations

from datetime import datetime, timezone

from pydantic import Field

from core import aws
from core.errors import RejectedUpload
from core.models import Frozen

PARTNER_PREFIX = "PARTNER#"


class Partner(Frozen):
    """A licensing partner: which licenses it grants us, under which key prefixes."""

    partner_id: str
    licenses: tuple[str, ...] = Field(min_length=1)
    prefixes: tuple[str, ...] = ("",)  # relative to `<partner_id>/`; "" allows every key
    terms: str = ""
    added_at: str = ""


def partner_pk(partner_id: str) -> str:
    return f"{PARTNER_PREFIX}{partner_id}"


def license_for(partner: Partner | None, partner_id: str, key: str, sidecar_license: str) -> str:
    """The license an upload is used under, or RejectedUpload("unlicensed") saying why not."""
    sidecar_license = sidecar_license.strip()
    if partner is None:
        raise RejectedUpload("unlicensed", f"partner {partner_id!r} is not in the registry")
    relative = key.split("/", 1)[1]
    if not any(relative.startswith(prefix) for prefix in partner.prefixes):
        raise RejectedUpload("unlicensed", f"{key!r} is under none of the partner's prefixes {list(partner.prefixes)}")
    if sidecar_license:
        if sidecar_license not in partner.licenses:
            raise RejectedUpload("unlicensed", f"license {sidecar_license!r} is not one {partner_id} holds")
        return sidecar_license
    if len(partner.licenses) == 1:
        return partner.licenses[0]  # the partner's only license applies
    raise RejectedUpload("unlicensed", f"no sidecar license, and {partner_id} holds several: {list(partner.licenses)}")


# --- the registry, in the pipeline table --------------------------------------------------------

def get_partner(table: str, partner_id: str) -> Partner | None:
    item = aws.get_item(table, partner_pk(partner_id))
    return Partner.model_validate_json(item["record"]) if item else None


def put_partner(table: str, partner: Partner) -> Partner:
    stamped = partner.model_copy(update={"added_at": partner.added_at or datetime.now(timezone.utc).isoformat(timespec="seconds")})
    aws.put_item(table, {"pk": partner_pk(partner.partner_id), "kind": "partner", "record": stamped.model_dump_json()})
    return stamped


def list_partners(table: str) -> list[Partner]:
    return sorted((Partner.model_validate_json(i["record"]) for i in aws.scan_prefix(table, PARTNER_PREFIX)),
                  key=lambda p: p.partner_id)
