"""trainer.runtime.run_state.RunState: the state a checkpoint saves and the record a run ends with."""

from collections import Counter

from trainer.runtime.run_state import RunState


def a_state() -> RunState:
    state = RunState(args={"steps": 4}, step=2, stage=0, loss_history=[(1, 0.5), (2, 0.25)],
                     history=[{"step": 2, "loss": 0.25, "img_per_s": 9.0, "data_wait_share": 0.0}], skipped_steps=1,
                     base_digest="ab" * 32)
    state.count({"corrupt": ["k9"], "shard": ["shard-b.tar"], "source": [("p", "cc-by-4.0"), ("p", "cc0")]})
    state.count({"corrupt": [], "shard": ["shard-a.tar"], "source": [("p", "cc-by-4.0")]})
    return state


def test_a_saved_state_comes_back_as_it_was_on_rank_0():
    saved = a_state().gathered().to_dict()
    assert saved == {"step": 2, "stage": 0, "args": {"steps": 4}, "loss_history": [(1, 0.5), (2, 0.25)],
                     "history": [{"step": 2, "loss": 0.25, "img_per_s": 9.0, "data_wait_share": 0.0}],
                     "corrupt": ["k9"], "shards_seen": ["shard-a.tar", "shard-b.tar"], "skipped_steps": 1,
                     "draws": {"p": {"cc-by-4.0": 2, "cc0": 1}}, "base_digest": "ab" * 32}
    assert RunState.from_dict(saved, rank=0) == a_state()


def test_a_checkpoint_saved_before_the_base_digest_was_recorded_resumes_with_none():
    saved = a_state().gathered().to_dict()
    del saved["base_digest"]
    assert RunState.from_dict(saved, rank=0).base_digest is None


def test_the_earlier_draws_come_back_on_rank_0_alone_so_the_sum_over_ranks_counts_them_once():
    resumed = RunState.from_dict(a_state().to_dict(), rank=1)
    assert resumed.draws == Counter()
    assert (resumed.corrupt, resumed.shards_seen) == ({"k9"}, {"shard-a.tar", "shard-b.tar"})


def test_the_record_is_atelier_training_json_s_layout():
    record = a_state().gathered().record({"unet": "tiny (random)"}, [{"resolution": 32}], "ema")
    assert record == {"args": {"steps": 4}, "steps": 2, "components": {"unet": "tiny (random)"}, "final_loss": 0.25,
                      "history": [{"step": 2, "loss": 0.25, "img_per_s": 9.0, "data_wait_share": 0.0}],
                      "stages": [{"resolution": 32}], "weights": "ema", "skipped_steps": 1, "corrupt_samples": ["k9"],
                      "shards_seen": ["shard-a.tar", "shard-b.tar"], "draws": {"p": {"cc-by-4.0": 2, "cc0": 1}}}
    assert RunState(args={}).record({}, [], "trained")["final_loss"] is None  # no step logged a loss
