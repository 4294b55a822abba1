"""minishard: see how training state is sharded across ranks, one event at a time.

The public API, re-exported; see ``docs/architecture.md`` for how the pieces fit. The names
follow PyTorch's where PyTorch has one (``fully_shard``, ``MixedPrecisionPolicy``, ``DDP``)::

    from minishard import DDP, ZeroOptimizer, fully_shard, checkpoint, train, TrainConfig
"""
from . import checkpoint, strategies
from .core.comm import Comm, ring_wire_bytes
from .training.config import TrainConfig
from .strategies.ddp import DDP, NaiveDDP
from .strategies.fsdp import MixedPrecisionPolicy, fully_shard
from .core.launch import RankContext, RankError, Ranks, release_captured_groups, run
from .planner.analytic import conventions, count_params, estimate, gpt_activation_bytes
from .core.ledger import LiveLedger
from .core.model import CONFIGS, GPT, GPTConfig, batch
from .core.model import config as model_config
from .training.parity import drift
from .core.trace import Tracer, TraceFormatError
from .instruments.watching import watch
from .training.loop import train, train_step
from .strategies.zero import ZeroOptimizer

# A process group that torch's own modules captured as a default argument outlives
# destroy_process_group, and its threads can abort the process at exit; whoever made the group,
# minishard drops those references (and imports torch.distributed.nn before any group exists, so
# that the first optimizer's import of torch._dynamo captures nothing): see launch.init_group.
release_captured_groups()

# ``minishard.training.config`` is the module of TrainConfig (``minishard/training/config.py``); a model's config is
# ``minishard.model_config("nano")``. (It was ``minishard.config("nano")``, which hid the module:
# calling the module now says so.)
__version__ = "0.1.0"
__all__ = ["checkpoint", "strategies", "Comm", "ring_wire_bytes", "TrainConfig", "DDP", "NaiveDDP",
           "MixedPrecisionPolicy", "fully_shard", "RankContext", "RankError", "Ranks", "run",
           "LiveLedger", "conventions", "count_params", "estimate", "gpt_activation_bytes",
           "CONFIGS", "GPT", "GPTConfig", "batch", "model_config", "drift", "Tracer", "TraceFormatError",
           "train", "train_step", "watch", "ZeroOptimizer"]
