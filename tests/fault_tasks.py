"""Rank tasks for tests/test_faults.py: the course's GPT trained with one fault planted
(``TrainConfig(fault=...)``, ``minishard.training.faults``), each rank leaving its flight dump and its
trace in a directory for the doctor."""
from minishard.training.loop import TrainConfig, train

SMALL = dict(model="nano", steps=2, micro_batch=2)


def trained(rank, directory: str, **knobs) -> list[float]:
    out = train(rank, TrainConfig(flight_dir=directory, **SMALL | knobs))
    rank.tracer.write_jsonl(f"{directory}/rank{rank.rank}.jsonl")
    return out["losses"]
