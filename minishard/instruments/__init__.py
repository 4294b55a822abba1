"""The instruments: what a run left behind, read back and explained.

    watching/       ``watch``: PyTorch's own DDP, ZeroRedundancyOptimizer and FSDP2 into the trace
    health.py       notes a rank takes each step (fingerprints, low-precision updates)
    torch_flight.py PyTorch's own Flight Recorder dumps, read as minishard's
    doctor.py       hangs and desyncs from the flight dumps; causes.py: the rest of its findings
    faults.py       the failures chapter 11 plants on purpose, for the doctor to find
"""
