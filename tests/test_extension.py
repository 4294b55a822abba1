"""One place per extension: a strategy is one registry entry (and its builder, in its own folder);
a doctor finding is one function and one line in ``causes.CAUSES``
(``tests/test_doctor_edges.py::test_a_new_finding_is_one_function_and_one_line_in_causes``).

Here a toy strategy, written outside minishard from its public pieces, is registered by one entry
and trains through ``train`` on 3 ranks that start from different weights: the config accepts
it, ``unused()`` judges its knobs by the entry's fields, and it ends bit-equal to ``ddp``."""
import rank_tasks


def test_a_new_strategy_is_one_registry_entry(pools):
    for r in pools(3).run(rank_tasks.a_toy_strategy_trains):
        assert r["strategy"] == "toy_ddp" and r["calls"] > 0
        assert r["losses"][0] == r["losses"][1] and r["equal"]
        assert r["unused"] == ["wrap"]          # a replicated strategy never reads FSDP's wrap
