"""``TrainConfig``: everything one training run is told, typed, documented and checked once.

Every knob a chapter teaches is a field here, with the value PyTorch (or the course) uses by
default; ``train(rank, TrainConfig(...))`` runs it, under ``Ranks``, ``torchrun`` or in one
process. Bad values are refused when the config is made — before any rank starts — with a
message that names the field and the values it accepts (a ``ConfigError``, which the command line
words in its flags). ``unused()`` names the knobs set for a strategy that never reads them.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from minishard.strategies.offload import TIERS

OPTIMIZERS = ("adamw", "sgd", "sgd_momentum")
PRECISIONS = ("fp32", "bf16_mixed")
WRAPS = ("block", "model", "linear")
OFFLOADS = (None, *TIERS)                 # no offload, or the tier offload keeps the state in
# gradient accumulation under FSDP and ZeRO-2 (accum > 1), between the micro-batches of a step
ACCUMULATIONS = ("sync", "no_sync", "gathered")


class ConfigError(ValueError):
    """A value ``TrainConfig`` refuses. The message is a template whose ``{field}`` names a
    field with its value: ``str(e)`` spells it as Python does (``prefetch=-1``), ``worded(spell)``
    as another interface does (the command line: ``--prefetch -1``), so that each names the
    input the way its user typed it. ``{field:name}`` names the field without its value (what
    to set, in the advice), and so does a field given as ``...``; ``python`` replaces the Python
    wording where it reads better on its own."""

    def __init__(self, template: str, *, python: str | None = None, **fields: Any):
        self.template, self.fields = template, fields
        super().__init__(python or self.worded(python_spelling))

    def worded(self, spell: Callable[[str, Any], str]) -> str:
        return self.template.format(**{k: _Spelled(spell, k, v) for k, v in self.fields.items()})


class _Spelled:
    """A field as ``str.format`` places it: ``{field}`` with its value, ``{field:name}`` without."""

    def __init__(self, spell: Callable[[str, Any], str], name: str, value: Any):
        self.spell, self.name, self.value = spell, name, value

    def __format__(self, spec: str) -> str:
        if spec not in ("", "name"):
            raise ValueError(f"ConfigError template: {{{self.name}:{spec}}}; use {{{self.name}}} or "
                             f"{{{self.name}:name}}")
        return self.spell(self.name, ... if spec == "name" else self.value)


def python_spelling(name: str, value: Any = ...) -> str:
    return name if value is ... else f"{name}={value!r}"


def _minishard_fsdp(s) -> bool:
    """minishard's own FSDP units (fsdp, fsdp_flat, hsdp), not PyTorch's ``fully_shard``."""
    return s.stage == 3 and s.instrumented


def _fsdp(s) -> bool:
    """FSDP units, minishard's or PyTorch's (DeepSpeed's stage 3 has none: it gathers submodules)."""
    return s.stage == 3 and s.library != "deepspeed"


def _zero3_bounds(s) -> bool:
    """DeepSpeed's ZeRO-3 bounds: minishard's FSDP, and DeepSpeed's stage 3 whose they are."""
    return _minishard_fsdp(s) or s.name == "deepspeed_zero3"


# Which strategies read each knob: a knob set away from its default under a strategy that never
# reads it would change nothing, silently. ``TrainConfig.unused()`` lists them; the command line
# refuses every one. ``TrainConfig`` itself refuses ``offload`` and the ZeRO-3 bounds; the others
# it accepts, because a Python sweep shares one set of keyword arguments between the strategies
# it compares and the one-process reference (the parity tests run ``single`` with the sweep's
# ``bucket_cap_mb``, ``wrap`` and ``reshard_root``).
KNOBS: dict[str, tuple[Callable[[Any], bool], str]] = {       # knob: (reads it?, who, in words)
    "bucket_cap_mb": (lambda s: s.buckets, "the strategies that reduce gradients in buckets"),
    "wrap": (_fsdp, "FSDP"),
    "reshard_after_forward": (_fsdp, "FSDP"),
    "reshard_root": (_minishard_fsdp, "minishard's FSDP"),
    "prefetch": (_fsdp, "FSDP"),
    "accumulation": (lambda s: _minishard_fsdp(s) or s.name in ("zero2", "torch_fsdp"), "FSDP and ZeRO-2"),
    "quantized_weights": (_minishard_fsdp, "minishard's FSDP"),
    "quantized_gradients": (_minishard_fsdp, "minishard's FSDP"),
    "shard_size": (lambda s: s.hybrid, "hybrid sharding"),
    "offload": (lambda s: s.offloads, "an FSDP strategy or DeepSpeed's ZeRO"),
    "prefetch_bucket_size": (_zero3_bounds, "an FSDP strategy or DeepSpeed's stage 3"),
    "max_live_parameters": (_zero3_bounds, "an FSDP strategy or DeepSpeed's stage 3"),
    "param_persistence_threshold": (_zero3_bounds, "an FSDP strategy or DeepSpeed's stage 3"),
}


@dataclass(frozen=True)
class TrainConfig:
    # what is trained, and how long
    strategy: str = "ddp"            # a name or alias of minishard.strategies (ddp, zero1, fsdp, ...)
    steps: int = 3                   # optimizer steps
    model: str = "tiny"              # a minishard.core.model config name
    model_overrides: dict = field(default_factory=dict)   # e.g. {"n_layer": 2}: config fields to change
    micro_batch: int = 4             # sequences per rank per forward
    accum: int = 1                   # micro-batches per optimizer step (gradient accumulation)
    seed: int = 0                    # initial weights (the same on every rank)
    rank_seeds: bool = False         # rank r builds its model from seed + r, as processes that
                                     # never agreed on a seed would: DDP, ZeRO and FSDP make every
                                     # rank start from rank 0's weights anyway
    data_seed: int = 1234            # the synthetic token stream
    # the optimizer and the numbers it works with
    optimizer: str = "adamw"         # adamw (weight decay 0.01), sgd, sgd_momentum (0.9)
    lr: float = 1e-3
    precision: str = "fp32"          # fp32, or bf16_mixed: bf16 compute, fp32 master and moments
    clip: float | None = None        # clip the global gradient norm to this
    freeze: tuple[str, ...] = ()     # parameters whose name starts with one of these get no grads
    # data parallelism: buckets (DDP, ZeRO-1/2) and units (FSDP)
    bucket_cap_mb: float = 25.0      # gradient bucket size, MiB (PyTorch's default)
    wrap: str = "block"              # FSDP units below the root: each block, each Linear, or none
    reshard_after_forward: bool | int = True   # free a unit's gathered parameters after its
                                     # forward; k: keep 1/k of them, gathered in backward over k ranks
    reshard_root: bool = False       # the root too (the textbook ZeRO-3 schedule; FSDP2 keeps it)
    prefetch: int = 0                # FSDP units gathered ahead, forward and backward
                                     # (torch_fsdp: FSDP2 gathers 1 ahead in backward at 0)
    # DeepSpeed's ZeRO-3 bounds, in elements (fsdp/limits.py): None leaves FSDP's depth rule
    prefetch_bucket_size: int | None = None   # stage3_prefetch_bucket_size: gathered ahead
    max_live_parameters: int | None = None    # stage3_max_live_parameters: gathered at once
    param_persistence_threshold: int | None = None   # stage3_param_persistence_threshold
    accumulation: str | None = None  # accum > 1, FSDP and ZeRO-2: "sync" reduce-scatters every
                                     # micro-batch, "no_sync" keeps full gradients and reduces once,
                                     # "gathered" (FSDP) keeps parameters gathered in between;
                                     # None: the strategy's own (sync; torch_fsdp no_sync)
    quantized_weights: bool | int = False    # ZeRO++ qwZ: FSDP's all-gathers in int8 (True, 8) or int4
    quantized_gradients: bool | int = False  # ZeRO++ qgZ: its gradient reduction so, all-to-all
    shard_size: int = 2              # hsdp: ranks per shard group ("a node")
    # memory
    recompute: bool = False          # activation recomputation: keep each block's input only
    loss_chunk_tokens: int | None = None   # compute the loss in chunks of this many tokens
    device_budget: int | None = None       # bytes: the ledger raises DeviceOutOfMemory past it
    offload: str | None = None       # FSDP's sharded state in "host" memory or on "disk"
    offload_dir: str | None = None   # where "disk" keeps its files (a folder per rank is made in it)
    # what the run records and returns
    track_activations: bool = True   # enter what autograd saves in the ledger
    trace: bool = True               # record events (the player replays them)
    flight_dir: str | None = None    # write each rank's flight recorder here (flight.py): at the
                                     # end, on an exception, on SIGTERM
    torch_flight: bool = False       # and PyTorch's own (c10d's) beside it, for the doctor
    fingerprint_every: int | None = 10   # with flight_dir: the replicas' fingerprints and the
                                     # optimizer's settings after every K-th step and the last
                                     # (instruments/replicas.py); None: after the last only
    return_params: bool = False      # the final parameters, gathered (parity tests)
    return_state: bool = False       # this rank's optimizer state_dict
    resume_from: str | None = None   # start from a checkpoint (any world size or strategy)
    save_to: str | None = None       # save a checkpoint after the last step
    save_every: int | None = None    # and after every K-th step (each replaces the one before)
    save_background: bool = False    # saves copy to host memory and write while training goes on

    def __post_init__(self):
        from minishard import strategies                # (the registry: names and aliases)
        from minishard.core.model import CONFIGS
        try:
            strategy = strategies.get(self.strategy)
        except ValueError:
            raise ConfigError("{strategy}: unknown strategy; expected one of " + strategies.described(),
                              python=f"unknown strategy {self.strategy!r}; expected one of "
                                     + strategies.described(), strategy=self.strategy) from None
        object.__setattr__(self, "strategy", strategy.name)
        object.__setattr__(self, "freeze", tuple(self.freeze))
        for name in ("steps", "micro_batch", "accum", "shard_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError("{%s}: must be an integer >= 1" % name, **{name: value})
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ConfigError("{prefetch}: must be an integer >= 0 (units gathered ahead)", prefetch=self.prefetch)
        for name in ("prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError("{%s}: a number of elements (an integer >= 0) or None" % name,
                                  **{name: value})
        _one_of("model", self.model, tuple(CONFIGS))
        self.model_config()                     # (a bad model_overrides, refused here)
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("wrap", self.wrap, WRAPS)
        _one_of("offload", self.offload, OFFLOADS)
        self._check_sharding(strategy)
        # (infinity too: an infinite learning rate or bucket is no setting, and a size or a norm
        # of it cannot be rounded to bytes or compared)
        for name in ("lr", "bucket_cap_mb"):
            if not _finite_positive(getattr(self, name)):
                raise ConfigError("{%s}: must be a positive, finite number" % name,
                                  **{name: getattr(self, name)})
        if self.clip is not None and not _finite_positive(self.clip):
            raise ConfigError("{clip}: must be a positive, finite gradient norm (or no clipping)",
                              clip=self.clip)
        if self.device_budget is not None and not _finite_positive(self.device_budget):
            raise ConfigError("{device_budget}: must be a positive, finite size",
                              device_budget=self.device_budget)
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 1:
            raise ConfigError("{loss_chunk_tokens}: must be >= 1 token", loss_chunk_tokens=self.loss_chunk_tokens)
        if self.offload == "disk" and not self.offload_dir:
            raise ConfigError("{offload} needs {offload_dir}: the folder its memory-mapped files go in",
                              offload="disk", offload_dir=...)
        if self.offload_dir is not None and self.offload is None:
            raise ConfigError("{offload_dir} is where {offload} keeps its files; set both, or neither",
                              offload_dir=self.offload_dir, offload="disk")
        self._check_saves()
        if not isinstance(self.torch_flight, bool):
            raise ConfigError("{torch_flight}: must be True or False", torch_flight=self.torch_flight)
        if self.torch_flight and self.flight_dir is None:
            raise ConfigError("{torch_flight} needs {flight_dir}: the directory the dumps are "
                              "written to", torch_flight=True, flight_dir=...)
        self._check_fingerprints()
        for name in ("offload", "prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold",
                     "accumulation", "quantized_weights", "quantized_gradients"):
            if name in self.unused():
                self.refuse_unused(only=(name,))

    def _check_sharding(self, strategy) -> None:
        k = self.reshard_after_forward
        if not isinstance(k, bool) and (not isinstance(k, int) or k < 1):
            raise ConfigError("{reshard_after_forward}: True, False, or the number of ranks a unit "
                              "reshards to after forward (an integer >= 1)", reshard_after_forward=k)
        _one_of("accumulation", self.accumulation, (None, *ACCUMULATIONS))
        from minishard.core.quantized import scheme_of     # (the one reading of the value: fully_shard's)
        for name in ("quantized_weights", "quantized_gradients"):
            try:
                scheme_of(getattr(self, name), name)
            except ValueError as e:
                raise ConfigError("{%(q)s}: ZeRO++ quantizes to 8 or 4 bits an element; give "
                                  "{%(q)s:name} (int8), {%(q)s:name} 8 or {%(q)s:name} 4" % {"q": name},
                                  python=str(e), **{name: getattr(self, name)}) from None
        if strategy.library == "deepspeed":
            self._check_deepspeed(strategy)
        if self.accumulation == "gathered" and strategy.name == "zero2":
            raise ConfigError("{accumulation} gathered keeps FSDP's parameters gathered between "
                              "micro-batches; ZeRO-2 holds them whole on every rank already (use "
                              "sync or no_sync)", accumulation="gathered")

    def _check_deepspeed(self, strategy) -> None:
        """What DeepSpeed's engine does not do under ``train`` (strategies/deepspeed_native.py)."""
        if self.precision != "fp32":
            raise ConfigError("{precision}: DeepSpeed's strategies train in fp32 here (this CPU has "
                              "no fast bf16 matmuls); use fp32", precision=self.precision)
        if self.accum != 1:
            raise ConfigError("{accum}: DeepSpeed's strategies take one micro-batch a step here "
                              "(DeepSpeed decides when to reduce by its own micro-step counter); "
                              "use accum 1, or give micro_batch the whole batch", accum=self.accum)
        if self.offload == "disk":
            raise ConfigError("{offload}: DeepSpeed's NVMe offload needs its async-I/O op, which "
                              "this install does not build (DS_BUILD_OPS=0); use host",
                              offload=self.offload)
        for name in ("save_to", "resume_from"):
            if getattr(self, name) is not None:
                raise ConfigError("{%s}: DeepSpeed saves its own checkpoints (engine.save_checkpoint); "
                                  "minishard.checkpoint.from_deepspeed turns one into minishard's"
                                  % name, **{name: getattr(self, name)})

    def _check_fingerprints(self) -> None:
        every = self.fingerprint_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ConfigError("{fingerprint_every}: must be an integer >= 1 (fingerprint the replicas "
                              "after every K-th step and the last), or None (after the last step "
                              "only)", fingerprint_every=every)
        default = next(f.default for f in dataclasses.fields(self) if f.name == "fingerprint_every")
        if every != default and self.flight_dir is None:
            raise ConfigError("{fingerprint_every} needs {flight_dir}: the fingerprints go into the "
                              "flight dumps written there", fingerprint_every=every, flight_dir=...)

    def _check_saves(self) -> None:
        every = self.save_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ConfigError("{save_every}: must be an integer >= 1 (save after every K-th step), "
                              "or None", save_every=every)
        if not isinstance(self.save_background, bool):
            raise ConfigError("{save_background}: must be True or False",
                              save_background=self.save_background)
        for name in ("save_every", "save_background"):
            if getattr(self, name) not in (None, False) and self.save_to is None:
                raise ConfigError("{%s} needs {save_to}: the directory each checkpoint is saved to"
                                  % name, **{name: getattr(self, name)}, save_to=...)

    def unused(self) -> list[str]:
        """The knobs set away from their default that this run's strategy never reads (``KNOBS``)."""
        from minishard import strategies
        strategy = strategies.get(self.strategy)
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [name for name, (reads, _) in KNOBS.items()
                if getattr(self, name) != defaults[name] and not reads(strategy)]

    def refuse_unused(self, only: tuple[str, ...] | None = None) -> None:
        """Raise ``ConfigError`` for the first knob of ``unused()`` (or of ``only``): the command
        line calls it, so that no flag is silently ignored. Without ``only``, also for two settings
        a run never reads that only the command line refuses: an ``offload_dir`` with no disk
        offload, and an ``accumulation`` mode at ``accum`` 1."""
        if only is None and self.offload_dir is not None and self.offload != "disk":
            raise ConfigError("{offload_dir} is not used by {offload}: only offload to disk keeps "
                              "files; drop it", offload_dir=self.offload_dir, offload=self.offload)
        # The command line's refusal only: TrainConfig accepts a mode at accum 1, where every mode
        # runs the same, so that a Python sweep over accum can share one accumulation between its
        # runs (and the knob table of tests/test_run_report.py sets it at the default accum).
        if only is None and self.accumulation is not None and self.accum == 1:
            raise ConfigError("{accumulation} applies only with more than one micro-batch a step (it "
                              "chooses what is held between them), not with {accum}: give {accum:name} "
                              "2 or more, or drop {accumulation:name}",
                              accumulation=self.accumulation, accum=self.accum)
        from minishard import strategies
        for name in self.unused():
            if only is None or name in only:
                reads, who = KNOBS[name]
                those = ", ".join(s.name for s in strategies.STRATEGIES.values() if reads(s))
                raise ConfigError("{%s} applies to %s only (%s), not to {strategy}; drop it, or choose "
                                  "one of those strategies" % (name, who, those),
                                  **{name: getattr(self, name)}, strategy=self.strategy)

    def model_config(self):
        """The ``GPTConfig`` this run trains: ``model`` with ``model_overrides``."""
        from minishard.core.model import GPTConfig
        from minishard.core.model import config as model_config
        overrides = self.model_overrides
        if not isinstance(overrides, dict):
            raise ConfigError("{model_overrides}: a dict of model config fields, e.g. {{'n_layer': 2}}",
                              model_overrides=overrides)
        fields = [f.name for f in dataclasses.fields(GPTConfig)]
        unknown = [k for k in overrides if k not in fields]
        if unknown:
            raise ConfigError("{model_overrides}: %s is not a field of a model config; its fields: %s"
                              % (unknown[0], ", ".join(fields)), model_overrides=overrides)
        try:
            return model_config(self.model, **overrides)
        except ValueError as e:
            raise ConfigError("{model_overrides}: %s" % str(e).replace("{", "{{").replace("}", "}}"),
                              model_overrides=overrides) from None

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _finite_positive(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) \
        and value > 0


def _one_of(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError("{%s}: unknown %s; expected one of %s"
                          % (name, name, ", ".join(str(a) for a in allowed if a is not None)),
                          **{name: value})
