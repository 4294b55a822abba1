"""Rank tasks for tests/test_faults.py: the course's GPT trained with one fault planted
(``train(..., hooks=Fault(name, rank))``, ``minishard.instruments.faults``), each rank leaving its
flight dump and its trace in a directory for the doctor."""
from minishard.instruments.faults import Fault
from minishard.training.loop import TrainConfig, train

SMALL = dict(model="nano", steps=2, micro_batch=2)


def trained(rank, directory: str, fault: str | None = None, fault_rank: int = 1, **knobs) -> list[float]:
    out = train(rank, TrainConfig(flight_dir=directory, **SMALL | knobs),
                hooks=None if fault is None else Fault(fault, fault_rank))
    rank.tracer.write_jsonl(f"{directory}/rank{rank.rank}.jsonl")
    return out["losses"]


def ledger_of(rank, fault: str | None, **knobs) -> dict:
    """The run's measured ledger and its formula, with ``fault`` planted on every rank."""
    out = train(rank, TrainConfig(**SMALL | knobs), hooks=None if fault is None else Fault(fault, rank.rank))
    return out["ledger"]
