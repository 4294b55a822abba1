"""minishard: see how training state is sharded across ranks, one event at a time.

The public API, re-exported; see ``docs/architecture.md`` for how the pieces fit.
"""
from .comm import Comm, ring_wire_bytes
from .ddp import DDP, NaiveDDP
from .launch import RankContext, RankError, Ranks, run
from .ledger import LiveLedger, conventions, count_params, estimate, gpt_activation_bytes
from .model import CONFIGS, GPT, GPTConfig, batch, config
from .trace import Tracer, TraceFormatError

__version__ = "0.1.0"
__all__ = ["Comm", "ring_wire_bytes", "DDP", "NaiveDDP", "RankContext", "RankError", "Ranks", "run",
           "LiveLedger", "conventions", "count_params", "estimate", "gpt_activation_bytes",
           "CONFIGS", "GPT", "GPTConfig", "batch", "config", "Tracer", "TraceFormatError"]
