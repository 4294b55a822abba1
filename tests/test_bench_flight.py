"""benchmarks/bench_flight.py's record of the replicas (``--replicas``): on the warm pool, one
record per rank as a run takes it, with XXH3 and with BLAKE2 beside it. No timing is asserted:
the times are whatever this machine gives."""
import sys
from pathlib import Path

import minishard

# the rank processes import the benchmark's task by its module's name: the pool starts after
# collection, with this path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_flight  # noqa: E402


def test_the_benchmark_measures_a_record_as_a_run_takes_it(pools):
    """``benchmarks/bench_flight.py --replicas``: one record of the replicas on each rank (the
    nano GPT here, the tiny one there), with XXH3 as recorded and BLAKE2 beside it; FSDP's shards
    are no replica."""
    ddp, fsdp = (pools(2).run(bench_flight.record_cost, s, repeats=1, model="nano") for s in ("ddp", "fsdp"))
    psi = minishard.GPT(minishard.model_config("nano"), device="meta").num_params()
    assert all(c["bytes"] == 4 * psi and c["xxh3"] > 0 and c["blake2"] > 0 for c in ddp), ddp
    assert all(c["bytes"] == 0 for c in fsdp), fsdp
