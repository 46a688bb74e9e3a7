"""RunState: where a training run stands, saved in every checkpoint and, at the end, its record.

trainer/jobs/train.py keeps one RunState through the loop. At a checkpoint `gathered()` merges every
rank's counts and `to_dict()` is what training_state.pt holds beside the optimizer
(trainer/runtime/checkpoints.py); after the last step `record()` is atelier-training.json's layout, which
the run's report (trainer/report/write.py), the evaluation job and the attribution report
(core/partners/attribution.py) read: {"args", "steps", "components", "final_loss", "history",
"stages", "weights", "skipped_steps", "corrupt_samples", "shards_seen", "draws"}.
"""

from collections import Counter
from dataclasses import dataclass, field, replace

import torch.distributed as dist


@dataclass
class RunState:
    args: dict  # this job's arguments (a resumed job's own, not those of the job it resumed)
    step: int = 0  # optimizer steps done
    stage: int | None = None  # the phase of the last step (saved as `stage`, as recorded runs have it)
    loss_history: list[tuple[int, float]] = field(default_factory=list)  # (step, mean loss) per log line
    history: list[dict] = field(default_factory=list)  # the logged figures per log line, for trainer/report/write.py
    skipped_steps: int = 0  # non-finite steps passed over
    corrupt: set[str] = field(default_factory=set)  # samples that could not be read (this rank's until gathered)
    shards_seen: set[str] = field(default_factory=set)  # (this rank's until gathered)
    # (partner, license) -> samples drawn, over every job that resumed the same checkpoints; the earlier
    # jobs' counts are carried by rank 0 alone so the sum over ranks counts them once
    draws: Counter = field(default_factory=Counter)
    # a LoRA run's base, by trainer/models/lora.py's digest of its files: a resumed adapter must find the same one
    base_digest: str | None = None

    def count(self, batch: dict) -> None:
        """A micro-batch's corrupt samples, shard and the partner and license of each sample drawn."""
        self.corrupt.update(batch["corrupt"])
        self.shards_seen.update(batch["shard"])
        self.draws.update(map(tuple, batch["source"]))

    def gathered(self) -> "RunState":
        """A copy holding every rank's corrupt samples, shards and draws (a collective: every rank calls it)."""
        everyone = [(self.corrupt, self.shards_seen, self.draws)]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (self.corrupt, self.shards_seen, self.draws))
        corrupt, shards, draws = zip(*everyone)
        return replace(self, loss_history=list(self.loss_history), history=list(self.history),
                       corrupt=set().union(*corrupt), shards_seen=set().union(*shards), draws=sum(draws, Counter()))

    def final_loss(self) -> float | None:
        return self.loss_history[-1][1] if self.loss_history else None

    def draws_by_partner(self) -> dict[str, dict[str, int]]:
        """{partner: {license: n}}, sorted."""
        nested: dict[str, dict[str, int]] = {}
        for (partner, license), count in sorted(self.draws.items()):
            nested.setdefault(partner, {})[license] = count
        return nested

    def to_dict(self) -> dict:
        """Plain data for training_state.pt (of a gathered state)."""
        return {"step": self.step, "stage": self.stage, "args": self.args, "loss_history": self.loss_history,
                "history": self.history, "corrupt": sorted(self.corrupt), "shards_seen": sorted(self.shards_seen),
                "skipped_steps": self.skipped_steps, "draws": self.draws_by_partner(), "base_digest": self.base_digest}

    @classmethod
    def from_dict(cls, saved: dict, rank: int) -> "RunState":
        """The state a checkpoint saved, as process `rank` continues it."""
        draws = Counter({(partner, license): n for partner, licenses in saved["draws"].items()
                         for license, n in licenses.items()} if rank == 0 else {})
        return cls(saved["args"], saved["step"], saved["stage"], list(saved["loss_history"]), list(saved["history"]),
                   saved["skipped_steps"], set(saved["corrupt"]), set(saved["shards_seen"]), draws,
                   saved.get("base_digest"))  # checkpoints written before it was recorded have none

    def record(self, components: dict[str, str], stages: list[dict], weights: str) -> dict:
        """atelier-training.json (of a gathered state): what the run did, from which components, to which weights."""
        return {"args": self.args, "steps": self.step, "components": components, "final_loss": self.final_loss(),
                "history": self.history, "stages": stages, "weights": weights, "skipped_steps": self.skipped_steps,
                "corrupt_samples": sorted(self.corrupt), "shards_seen": sorted(self.shards_seen),
                "draws": self.draws_by_partner()}
