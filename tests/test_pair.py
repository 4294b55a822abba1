"""PlayerPair: minishard's FSDP and torch's FSDP2 (watched) under one slider, by step and phase."""
import pytest

from minishard.training.loop import TrainConfig, train
from minishard.viz import PlayerPair
from minishard.viz.pair import moments, shared_moments

KW = dict(model="nano", steps=2, micro_batch=2, prefetch=1)


@pytest.fixture(scope="module")
def traces(pools):
    from minishard.course.side_by_side import traces
    return traces(pools(2), "fsdp", "torch_fsdp", **KW)


def test_the_pair_moves_both_players_to_the_same_moment(traces):
    mine, theirs = traces
    pair = PlayerPair(mine, theirs, titles=("minishard FSDP", "torch FSDP2"))
    # both traces have each phase's begin and end, every step, in the same order
    assert pair.moments == moments(mine) == moments(theirs)
    assert len(pair.moments) == 2 * 3 * KW["steps"]
    i, j = pair.show("backward", step=1)
    for player, k in ((pair.left, i), (pair.right, j)):
        e = player.replay.events[k]
        assert player.index == k
        assert (e["kind"], e["name"], e["edge"], e["step"], e["rank"]) == ("phase", "backward", "begin", 1, 0)
    # at backward's begin both hold the shards and the root plus the last block gathered
    assert pair.left.snapshot()[0]["params"] == pair.right.snapshot()[0]["params"]
    assert pair.left.snapshot()[0]["unsharded"] == pair.right.snapshot()[0]["unsharded"]
    # the slider drives them too (the browser moves it)
    pair._slider.value = "step 0 · optimizer · end"
    assert pair.left.replay.events[pair.left.index]["name"] == "optimizer"
    assert pair.right.replay.events[pair.right.index]["step"] == 0


def test_a_moment_they_do_not_share_is_refused(traces):
    mine, theirs = traces
    pair = PlayerPair(mine, theirs)
    with pytest.raises(KeyError, match="step 7 · backward · begin is not a moment both traces have"):
        pair.show("backward", step=7)
    only_forward = [e for e in theirs if not (e["kind"] == "phase" and e["name"] != "forward")]
    assert {m[1] for m in shared_moments(mine, only_forward)} == {"forward"}
    with pytest.raises(ValueError, match="share no phase"):
        PlayerPair(mine, [e for e in theirs if e["kind"] != "phase"])


def test_a_live_player_follows_a_watched_torch_job(pools):
    """The live Player, fed as PyTorch's FSDP2 trains under the watch (``train`` runs it so)."""
    from minishard.viz import Player
    p = Player()
    pool = pools(2)
    pool.run(train, TrainConfig(strategy="torch_fsdp", model="nano", steps=1, micro_batch=2), on_event=p.feed)
    p.flush()
    assert p.replay.n == len(pool.last_events) > 0
    assert p.index == p.replay.n - 1                         # it follows the newest event
    assert sorted(p.replay.unit_names) == ["blocks.0", "blocks.1", "blocks.2", "root"]
