"""License rules in one place: the partner registry, the license an upload is used under, the
terms that limit training on it (a last day, allowed uses) and takedowns (docs/provenance.md).

Ingest asks `license_for` whether an upload may become a sample; the manifest builder asks a
`Rules` whether a sample may still be trained on, today, for the pipeline's use.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated

from pydantic import Field

from contracts import pipeline_table
from contracts.messages import SHA256_PATTERN, Frozen
from core import aws
from core.errors import RejectedUpload

ISO_DATE = r"^\d{4}-\d{2}-\d{2}$"


class Terms(Frozen):
    """What one of a partner's licenses (or, with `license` empty, every one) allows."""

    license: str = ""
    not_after: str = Field(default="", pattern=f"{ISO_DATE}|^$")  # no training on these samples after this day (UTC)
    uses: tuple[str, ...] = ()  # the uses allowed, e.g. ("research",); empty: any use


class Partner(Frozen):
    """A licensing partner: which licenses it grants us, under which key prefixes."""

    partner_id: str
    licenses: tuple[str, ...] = Field(min_length=1)
    prefixes: tuple[str, ...] = ("",)  # relative to `<partner_id>/`; "" allows every key
    terms: str = ""  # free text: contract reference, ...
    added_at: str = ""
    rules: tuple[Terms, ...] = ()  # enforced by the manifest builder; absent from older records
    # IAM roles or users that may assume its upload role (core.partners.partner_access); none: no role
    principals: tuple[str, ...] = ()


class Revocation(Frozen):
    """A takedown: the samples it covers are left out of every manifest built after it."""

    partner: str
    license: str = ""  # "" : every license
    sha256s: tuple[Annotated[str, Field(pattern=SHA256_PATTERN)], ...] = ()  # empty: every sample of the partner (and license)
    reason: str = Field(min_length=1)
    at: str = ""

    @property
    def revocation_id(self) -> str:
        """The same takedown recorded twice is one item."""
        what = json.dumps([self.partner, self.license, sorted(self.sha256s)])
        return hashlib.sha256(what.encode()).hexdigest()[:20]

    def covers(self, partner: str, license: str, sha256: str) -> bool:
        return (partner == self.partner and (not self.license or license == self.license)
                and (not self.sha256s or sha256 in self.sha256s))

    def describe(self) -> str:
        return f"revoked {self.at[:10]}: {self.reason}" if self.at else f"revoked: {self.reason}"

    @property
    def needs_samples(self) -> bool:
        """Whether it tells samples of the partner apart (by license or key), not all of them."""
        return bool(self.license or self.sha256s)


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
    item = aws.get_item(table, pipeline_table.partner_pk(partner_id))
    return Partner.model_validate_json(item["record"]) if item else None


def put_partner(table: str, partner: Partner) -> Partner:
    stamped = partner.model_copy(update={"added_at": partner.added_at or datetime.now(timezone.utc).isoformat(timespec="seconds")})
    # A partner without principals is stored as before this field: functions deployed before it still read it.
    record = stamped.model_dump_json(exclude={"principals"} if not stamped.principals else None)
    aws.put_item(table, {"pk": pipeline_table.partner_pk(partner.partner_id), "kind": "partner", "record": record})
    return stamped


def list_partners(table: str) -> list[Partner]:
    found = aws.scan_prefix(table, pipeline_table.PARTNER_PREFIX)
    return sorted((Partner.model_validate_json(i["record"]) for i in found),
                  key=lambda p: p.partner_id)


# --- training on a sample: terms and takedowns --------------------------------------------------

@dataclass(frozen=True)
class Rules:
    """The registry's terms and the takedowns, as a manifest built on `day` for `use` sees them."""

    partners: dict[str, Partner | None]  # a partner missing from the registry: ingest checked it; no terms
    revocations: tuple[Revocation, ...]
    use: str
    day: str  # ISO date, UTC

    def reason(self, partner: str, license: str, sha256: str) -> str | None:
        """Why this sample may not be trained on, or None."""
        for revocation in self.revocations:
            if revocation.covers(partner, license, sha256):
                return revocation.describe()
        return self._terms_reason(partner, license)

    def partner_reason(self, partner: str) -> str | None:
        """Why no sample of the partner may be trained on (whatever its license or key), or None."""
        for revocation in self.revocations:
            if revocation.partner == partner and not revocation.needs_samples:
                return revocation.describe()
        registered = self.partners.get(partner)
        if registered is None:
            return None
        reasons = {self._terms_reason(partner, license) for license in registered.licenses}
        return reasons.pop() if len(reasons) == 1 and None not in reasons else None

    def affects(self, partner: str) -> bool:
        """Whether any term or takedown could leave out a sample of the partner (else: no reads)."""
        registered = self.partners.get(partner)
        return (any(r.partner == partner for r in self.revocations)
                or (registered is not None and any(self._violated(t) for t in registered.rules)))

    def _terms_reason(self, partner: str, license: str) -> str | None:
        registered = self.partners.get(partner)
        for terms in registered.rules if registered else ():
            if terms.license in ("", license) and self._violated(terms):
                return self._violation(partner, terms)
        return None

    def _violated(self, terms: Terms) -> bool:
        return bool(terms.not_after and self.day > terms.not_after) or bool(terms.uses and self.use not in terms.uses)

    def _violation(self, partner: str, terms: Terms) -> str:
        scope = f"terms of {partner} ({terms.license or 'every license'})"
        if terms.not_after and self.day > terms.not_after:
            return f"{scope}: no training after {terms.not_after}"
        return f"{scope}: {', '.join(terms.uses)} use only, not {self.use}"


def rules_for(table: str, partners: set[str], use: str, now: datetime | None = None) -> Rules:
    """The registry entries of these partners and every takedown, for a manifest built now."""
    day = (now or datetime.now(timezone.utc)).date().isoformat()
    return Rules({p: get_partner(table, p) for p in sorted(partners)}, tuple(list_revocations(table)), use, day)


def revoke(table: str, revocation: Revocation) -> Revocation:
    """Record a takedown (idempotent: the same partner, license and samples are one item)."""
    stamped = revocation.model_copy(update={"at": revocation.at or datetime.now(timezone.utc).isoformat(timespec="seconds")})
    aws.put_item_if_absent(table, pipeline_table.revocation_item(stamped.revocation_id, stamped.at, stamped.model_dump_json()))
    item = aws.get_item(table, pipeline_table.revocation_pk(stamped.revocation_id)) or {}
    return Revocation.model_validate_json(item["record"])


def list_revocations(table: str) -> list[Revocation]:
    """Every takedown, oldest first (a sparse index partition, not a table scan)."""
    return [Revocation.model_validate_json(i["record"])
            for i in aws.query_index(table, pipeline_table.PENDING_INDEX, pipeline_table.REVOCATIONS)]

