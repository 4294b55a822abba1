"""The core every strategy stands on: ranks, collectives, the memory ledger, the trace.

    launch.py       start N ranks (gloo on CPU, NCCL on GPUs) and keep them warm
    comm.py         the collectives, each one counted: bytes on the wire, time, the ledger
    quantized.py    ZeRO++'s int8/int4 collectives (block scales, then the values)
    flight.py       a rank's last collectives, written however the run ends; flight_file.py
                    the same on disk as it flies; run_id.py the id every file of a run carries
    ledger.py       the memory ledger: every allocation by category, live and at its peak
    trace.py        the events every rank emits, and their reader
    model.py        the small GPT every chapter trains; hf_config.py reads real models' configs
    words.py        how a number of bytes and a dtype are written, everywhere; lines.py how a
                    damaged line of a file is named
    c10d.py         the private c10d it leans on (group timeouts, PyTorch's flight recorder),
                    and the one thing ``import minishard`` does to torch
    autograd_private.py   the private autograd the strategies lean on, as PyTorch's DDP and FSDP2 do
"""
