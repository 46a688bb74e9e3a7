"""A lineage's record in the pipeline table: its lock, sequence and queue, its brake, and the base
its checkpoints were trained from. Pure builders of the items and updates core.start_training.starter
writes (docs/training-jobs.md has the protocol)."""

from __future__ import annotations

from typing import Any

from contracts import pipeline_table
from core.start_training import failure_brake
from core.start_training.pretrained import PretrainedBase

NO_BASE = "none"  # a lineage's base_digest when it trains without PretrainedModelUri
Update = tuple[str, str, str, dict[str, Any]]  # (pk, update expression, condition, values) of a transaction
CLAIM_NAMES = {"#q": "queue", "#seq": "sequence"}  # the names claim_update's expressions use


def new_item(lineage: str) -> dict[str, Any]:
    """A lineage before its first claim: free, nothing queued, nothing trained."""
    return {"pk": pipeline_table.lineage_pk(lineage), "kind": "lineage", "sequence": 0, "steps_done": 0,
            "queue": [], "running_job": ""}


def base_digest(base: PretrainedBase | None) -> str:
    return base.digest if base else NO_BASE


def base_change(lock: dict[str, Any], base: PretrainedBase | None) -> str | None:
    """Why the lineage may not go on with this base: its checkpoints were trained from another."""
    recorded = lock.get("base_digest")
    if recorded is None or recorded == base_digest(base):
        return None
    was = "no base" if recorded == NO_BASE else f"the base with digest {recorded[:16]}"
    now = f"{base.uri} (digest {base.digest[:16]})" if base else "no base"
    return (f"BaseChanged: lineage {pipeline_table.lineage_name(lock['pk'])} was trained from {was}, and "
            f"PretrainedModelUri now gives {now}: its checkpoints do not fit another base. Set TrainingLineage to "
            "a new name to train on the new base, or set PretrainedModelUri back; then `atelier lineage resume`")


def claim_update(lineage: str, name: str, sequence: int, queue: bool, autoencoder: bool,
                 base: PretrainedBase | None, tokenizer: bool = False, recipe_digest: str = "") -> Update:
    """The claim's change to the lineage: the lock taken (or, under the `queue` policy while a job
    runs, the job queued), the sequence moved on, the recipe of its latest claim, and at its first claim
    whether it trains its own VAE and its own tokenizer, and from which base."""
    values: dict[str, Any] = {":next": sequence + 1, ":seq": sequence, ":empty": "", ":ae": autoencoder,
                              ":bd": base_digest(base), ":tok": tokenizer, ":rd": recipe_digest}
    values.update({":one": [name]} if queue else {":job": name})
    return (
        pipeline_table.lineage_pk(lineage),
        ("SET #q = list_append(#q, :one), #seq = :next" if queue else "SET running_job = :job, #seq = :next")
        + ", autoencoder = if_not_exists(autoencoder, :ae), base_digest = if_not_exists(base_digest, :bd)"
        + ", tokenizer = if_not_exists(tokenizer, :tok), recipe = :rd",
        "running_job <> :empty AND #seq = :seq" if queue else "running_job = :empty AND #seq = :seq",
        values,
    )


def brake_update(brake: failure_brake.Brake) -> tuple[str, dict[str, Any], dict[str, str]]:
    """(update expression, values, names) that write the brake's fields onto the lineage."""
    item = brake.to_item()
    return ("SET " + ", ".join(f"#{k} = :{k}" for k in item), {f":{k}": v for k, v in item.items()},
            {f"#{k}": k for k in item})
