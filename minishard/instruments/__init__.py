"""The instruments: what a run left behind, read back and explained.

    watching/       ``watch``: PyTorch's own DDP, ZeroRedundancyOptimizer and FSDP2 into the trace
    health.py       notes a rank takes each step (fingerprints, low-precision updates)
    torch_flight.py PyTorch's own Flight Recorder dumps, read as minishard's
    records.py      what the ranks left: their flight dumps, the rings of those that died, traces
    one_run.py      whether those files are one run's (its id, its world size): else refused
    cut_short.py    a trace a death cut short, lined up with the others before they are compared
    doctor.py       hangs, desyncs and deaths from those records; causes.py: the rest of its findings
    endings.py      how each rank's run ended (raised, gave up waiting, died, left no record), in words
    entries.py      a recorded collective, and the ranks a finding names, in the doctor's words
    faults.py       the failures chapter 11 plants on purpose, for the doctor to find
"""
