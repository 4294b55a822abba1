"""minishard: see how training state is sharded across ranks, one event at a time.

The public API is re-exported here; its names follow PyTorch's where PyTorch has one
(``fully_shard``, ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``, ``DDP``;
``docs/side-by-side.md`` lists them and shows they agree)::

    from minishard import DDP, ZeroOptimizer, fully_shard, checkpoint, train, TrainConfig

The parts, one folder each (each folder's ``__init__.py`` is its map)::

    core/          ranks, collectives, the memory ledger, the trace: what every strategy stands on
    strategies/    DDP, ZeRO-1/2, FSDP (ZeRO-3 as PyTorch's FSDP2), and their registry
    training/      the training loop, its config and its measurements
    checkpoint/    sharded checkpoints: save, load on another world size, export
    planner/       memory and time of a plan before any rank runs
    instruments/   watch PyTorch's own jobs; the doctor; PyTorch's flight dumps
    viewers/       a trace in words, as an offline HTML player, for Perfetto
    cli/           ``python -m minishard ...``
    viz/, course/  the notebooks' widgets and the course's code (the engine imports neither)

What to read, in this order (lines today; ``docs/architecture.md`` has the whole path)::

    DDP        training/step.py (train_step) -> strategies/ddp.py -> strategies/buckets.py
               -> core/comm.py -> core/ledger.py                        ~1,260 lines
    ZeRO-1/2   strategies/zero.py -> strategies/clipping.py               ~440 more
    FSDP       strategies/fsdp/: api.py -> state.py -> unit.py -> layout.py -> hooks.py
               -> recipe.py                                              ~1,640 more
"""
from . import checkpoint, strategies
from .core.comm import Comm, ring_wire_bytes
from .training.config import TrainConfig
from .strategies.ddp import DDP, NaiveDDP
from .strategies.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from .core.c10d import release_captured_groups
from .core.launch import RankContext, RankError, Ranks, run
from .planner.analytic import conventions, count_params, estimate, gpt_activation_bytes
from .core.ledger import LiveLedger
from .core.model import CONFIGS, GPT, GPTConfig, batch
from .core.model import config as model_config
from .training.parity import drift
from .core.trace import Tracer, TraceFormatError
from .instruments.watching import watch
from .instruments.health import fingerprint_model as fingerprint
from .training.loop import train, train_step
from .strategies.zero import ZeroOptimizer

# A process group that torch's own modules captured as a default argument outlives
# destroy_process_group, and its threads can abort the process at exit; whoever made the group,
# minishard drops those references (and imports torch.distributed.nn before any group exists, so
# that the first optimizer's import of torch._dynamo captures nothing): see core/c10d.py, init_group.
release_captured_groups()

__version__ = "0.1.0"
__all__ = ["checkpoint", "strategies", "Comm", "ring_wire_bytes", "TrainConfig", "DDP", "NaiveDDP",
           "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "fully_shard", "RankContext", "RankError", "Ranks", "run",
           "LiveLedger", "conventions", "count_params", "estimate", "gpt_activation_bytes",
           "CONFIGS", "GPT", "GPTConfig", "batch", "model_config", "drift", "Tracer", "TraceFormatError",
           "train", "train_step", "watch", "fingerprint", "ZeroOptimizer"]
