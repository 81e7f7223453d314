"""`ZeroConfig`: what `zerolite.shard` builds, validated once, frozen.

Each field says where it is declared what it defaults to and which ``ZEROLITE_*``
environment variable can set it (``setting(default, "ZEROLITE_...", parser)``), with its
docstring under it. Precedence, field by field: an explicit argument beats the variable,
which beats the default. Fields the user did not pass are resolved in ``__post_init__``, so
``ZeroConfig()`` read inside a job launched with ``ZEROLITE_STAGE=1`` is a stage-1 config,
while ``ZeroConfig(stage=2)`` stays stage 2. Every value is then checked against one table,
`_RULES` (one row per field: what is allowed), and the few rules that tie two fields
together (`ZeroConfig._check_together`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zerolite.ground.config_env import (
    COLLECTIVES,
    OFFLOAD_TIERS,
    PARTITIONS,
    QUANT_BLOCK_RANGE,
    UNSET,
    parse_bool,
    parse_choice,
    parse_device,
    parse_float,
    parse_group_size,
    parse_int,
    parse_names,
    parse_optional_choice,
    parse_optional_dtype,
    parse_path,
)
from zerolite.ground.dtype_names import accepted_names, as_dtype

__all__ = ["ZeroConfig"]


def setting(default: Any, env: str, parse: Callable[[str, str], Any]) -> Any:
    """A `ZeroConfig` field that defaults to ``default`` and that the environment variable
    ``env`` sets, its text read by ``parse(field, text)`` (`zerolite.ground.config_env`), when
    the caller does not pass it."""
    return dataclasses.field(
        default=UNSET, metadata={"default": default, "env": env, "parse": parse}
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How `zerolite.shard` shards a model and its optimizer (keyword arguments only).

    Each field below gives its default and, for most, the ``ZEROLITE_*`` variable that
    sets it when the argument is not given.

    Raises:
        ValueError: a field (or its environment variable) holds an invalid value; the
            message names the field, the value and what is allowed.
    """

    stage: int = setting(2, "ZEROLITE_STAGE", parse_int)
    """1 shards optimizer state (fp32 masters and moments); 2 also shards gradients,
    reduce-scattered during backward; 3 also shards parameters, all-gathered per unit just
    before use. 0 means plain DDP and is only meaningful to the memory estimator: `shard()`
    rejects it."""

    param_dtype: torch.dtype | None = setting(None, "ZEROLITE_PARAM_DTYPE", parse_optional_dtype)
    """dtype of the compute copy of every managed parameter. The fp32 master is this rank's
    shard: with ``torch.float32`` it is the parameter storage itself (no second copy).
    ``None`` keeps the model's own dtype: `shard()` takes the one floating dtype that every
    parameter the optimizer trains shares (a model loaded in bf16 trains bf16 parameters
    with fp32 master shards; an fp32 model trains in fp32), and refuses trained parameters
    of mixed dtypes or float64, naming them (`zerolite.plan.precision.resolve_param_dtype`).
    After `shard()`, ``sharded.config.param_dtype`` is the dtype chosen. Names are accepted
    and stored as the dtype (``"bf16"``, ``"bfloat16"``, ``"fp32"``, ``"half"``...:
    `zerolite.ground.dtype_names`), by the variable too, or ``none``."""

    reduce_dtype: torch.dtype | None = setting(
        None, "ZEROLITE_REDUCE_DTYPE", parse_optional_dtype
    )
    """dtype in which gradients are reduced and their shards kept; ``None`` means
    ``param_dtype``. Names are accepted as for ``param_dtype``."""

    bucket_size_mb: float = setting(25.0, "ZEROLITE_BUCKET_SIZE_MB", parse_float)
    """Size of a flat buffer (and so of one reduce-scatter / all-gather) in MiB of
    ``param_dtype`` elements; a parameter larger than this gets a buffer of its own."""

    process_group: dist.ProcessGroup | DeviceMesh | None = None
    """The data-parallel group; ``None`` is the default group (or a single process when
    ``torch.distributed`` is not initialised). A 2-D
    ``torch.distributed.device_mesh.DeviceMesh`` (replicate x shard) shards along its second
    dimension and replicates along its first (hybrid sharding, see ``shard_group_size``)."""

    device: torch.device | None = setting(None, "ZEROLITE_DEVICE", parse_device)
    """Where flat buffers live; ``None`` keeps the parameters' own device (a model built on
    the meta device: the process group's CUDA device under NCCL -- its bound ``device_id``,
    else the current CUDA device -- otherwise the CPU; see `zerolite.comm.devices`).
    ``"cuda"`` means the current CUDA device at `shard()`."""

    elementwise_optimizers: tuple[type[torch.optim.Optimizer], ...] = ()
    """Optimizer classes, beyond zerolite's allow-list, that the user declares elementwise
    (their update of an element depends only on that element's own gradient and state), so
    stepping 1-D shards is exact."""

    unit_modules: tuple[type[torch.nn.Module], ...] | Callable[[torch.nn.Module], bool] | None = (
        None
    )
    """Stage 3: which modules are gathered together as one unit. ``None`` makes each element
    of every ``nn.ModuleList`` a unit; a tuple of module classes, or a callable ``module ->
    bool``, picks them instead. The root module is always a unit, holding every parameter no
    other unit holds."""

    prefetch: int = setting(1, "ZEROLITE_PREFETCH", parse_int)
    """Stage 3: units whose all-gather starts ahead of use (next units in forward, previous
    ones in backward)."""

    reshard_after_forward: bool = setting(True, "ZEROLITE_RESHARD_AFTER_FORWARD", parse_bool)
    """Stage 3: free each unit's full parameters after its forward (and gather again for
    backward). The root unit stays gathered from forward to backward either way. ``False``
    also keeps units gathered after a forward without gradients (evaluation, a
    ``generate()`` loop: no gather per token) until the next backward ends; a step's updates
    are gathered again before the next use."""

    collectives: str = setting("auto", "ZEROLITE_COLLECTIVES", parse_choice)
    """How reduce-scatters and all-gathers travel. ``"native"``: torch.distributed's own
    kernels (what NCCL runs); ``"point_to_point"``: built from ``isend``/``irecv``, each
    exchange tagged with its sequence number (gloo has a slow all-gather and runs
    reduce-scatter as a full all-reduce); ``"auto"``: point-to-point on gloo, native
    otherwise."""

    timeout_s: float = setting(600.0, "ZEROLITE_TIMEOUT_S", parse_float)
    """Seconds any zerolite collective over gloo may wait for the other ranks before it
    raises `zerolite.CollectiveTimeout` naming the operation and the step (a rank that
    skipped ``step()``, saved alone or died). Not used on NCCL: there a wait with a timeout
    would block the host until the kernel finished, so zerolite waits without one (the
    current CUDA stream waits for the exchange) and the bound is the process group's own
    timeout (``init_process_group(timeout=...)``), enforced by NCCL's watchdog."""

    offload: str | None = setting(None, "ZEROLITE_OFFLOAD", parse_optional_choice)
    """Where this rank's share of the optimizer state lives (its moments, and the fp32
    masters when parameters are 16-bit; fp32 masters are the parameters and stay): ``None``
    in compute memory; ``"disk"``: a preallocated file per rank under ``offload_dir``;
    ``"host"``: pinned host memory for a CUDA model (a separate host arena on CPU). The step
    streams it through in chunks (see `zerolite.optim.streamed_step`)."""

    offload_dir: str | None = setting(None, "ZEROLITE_OFFLOAD_DIR", parse_path)
    """``"disk"``: a writable directory for the files (removed when the model is
    garbage-collected or the process exits). A missing one is created by `shard()` when its
    parent is an existing, writable directory (not here: a config is a value, built also
    where nothing trains, e.g. by ``zerolite plan``)."""

    offload_fraction: float = setting(1.0, "ZEROLITE_OFFLOAD_FRACTION", parse_float)
    """The fraction, in (0, 1], of this rank's shard elements whose state is offloaded,
    rounded up to whole parameter pieces (the first pieces in layout order)."""

    offload_params: str | None = setting(None, "ZEROLITE_OFFLOAD_PARAMS", parse_optional_choice)
    """Stage 3 only: where this rank's parameter shards and gradient shards live between
    uses (`zerolite.params.tiered_shard`). ``None``: in compute memory; ``"disk"``: a
    preallocated file per rank under ``offload_dir`` (its own, beside the optimizer's);
    ``"host"``: a host arena. A unit's parameter shard is read just before its all-gather
    (the next unit's is read ahead while this one computes) and freed right after; a
    gradient shard is written back after each reduce-scatter; the step brings one bucket's
    shards in at a time. Composes with ``offload`` (the optimizer state's tier), which is
    separate."""

    shard_group_size: int | str | None = setting(
        None, "ZEROLITE_SHARD_GROUP_SIZE", parse_group_size
    )
    """Hybrid sharding (`zerolite.comm.hybrid`). ``None``: shard over the whole
    data-parallel group. An int k: shard within consecutive groups of k ranks (ranks 0..k-1,
    k..2k-1, ...) and replicate across the groups; gradients are reduce-scattered within a
    group, then each shard is all-reduced across the groups. ``"node"``: k =
    ``LOCAL_WORLD_SIZE`` (shard within a machine). k must divide the world size. The
    variable reads ``none``, ``node`` or k."""

    init_fn: Callable[[torch.nn.Module], None] | None = None
    """For a model built under ``torch.device("meta")`` only: called as ``init_fn(module)``
    on every module (children before parents, as ``nn.Module.apply``) once its parameters
    have storage, instead of each module's own ``reset_parameters()``. It must draw from the
    default generator only, so every rank computes the same values (see
    `zerolite.params.meta_init`)."""

    partition: str = setting("auto", "ZEROLITE_PARTITION", parse_choice)
    """How trained parameters are split over ranks (see `zerolite.plan.owners`).
    ``"flat"``: every flat buffer in equal 1-D shards (elementwise optimizers only).
    ``"tensor"``: each parameter whole on one owner rank, which steps it in its own shape, so
    any optimizer that steps tensor by tensor works (Muon, Adafactor). ``"auto"``: ``"flat"``
    when every optimizer is elementwise, ``"tensor"`` otherwise. Stages 1-2."""

    quantize_gather: bool = setting(False, "ZEROLITE_QUANTIZE_GATHER", parse_bool)
    """Every parameter all-gather (stage 3's unit gathers, stages 1-2's post-step publish)
    sends int8 blocks of ``quant_block`` elements with one fp32 scale each; every rank, the
    owner included, computes with the same dequantized values, and the fp32 masters stay
    exact (`zerolite.comm.codec`). Refused with fp16 parameters."""

    quantize_reduce: bool = setting(False, "ZEROLITE_QUANTIZE_REDUCE", parse_bool)
    """Every gradient reduce-scatter sends each rank's contribution as int8 blocks;
    receivers dequantize and sum in fp32 in rank order. Refused with fp16 gradients
    (loss-scaled residuals)."""

    quant_block: int = setting(256, "ZEROLITE_QUANT_BLOCK", parse_int)
    """Elements per quantization block (16 to 2**20)."""

    quantize_skip: tuple[str, ...] = setting((), "ZEROLITE_QUANTIZE_SKIP", parse_names)
    """Names of parameters (as ``model.named_parameters()`` spells them) that always travel
    unquantized; parameters of fewer than ``quant_block`` elements do too. The variable is
    comma-separated."""

    error_feedback: bool = setting(True, "ZEROLITE_ERROR_FEEDBACK", parse_bool)
    """With ``quantize_reduce``, keep each rank's quantization error (fp32, (N-1)/N of the
    gradient buffers per rank) and add it to the next exchange's contribution; ``False``
    saves that memory at an accuracy cost (docs/hybrid-and-quantized.md)."""

    # Fields with environment variables that took their default (no argument, no variable):
    # integrations may fill those from their own settings (Accelerate's mixed_precision).
    _defaulted: frozenset[str] = dataclasses.field(
        default=frozenset(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        defaulted = set()
        for field in dataclasses.fields(self):
            if "env" not in field.metadata or getattr(self, field.name) is not UNSET:
                continue
            raw = os.environ.get(field.metadata["env"])
            if raw is None:
                defaulted.add(field.name)
                value = field.metadata["default"]
            else:
                value = field.metadata["parse"](field.name, raw)
            object.__setattr__(self, field.name, value)
        object.__setattr__(self, "_defaulted", frozenset(defaulted))
        for rule in _RULES:
            object.__setattr__(self, rule.field, rule.check(getattr(self, rule.field)))
        self._check_together()

    def is_set(self, name: str) -> bool:
        """Whether field ``name`` was given, as an argument or by its ``ZEROLITE_*`` variable.

        False means it holds its default, which an integration may replace with its own
        setting (e.g. ``param_dtype`` from Accelerate's ``mixed_precision`` or a Trainer's
        ``args.bf16``). A config made by ``dataclasses.replace`` has every field set.

        Raises:
            ValueError: ``name`` is not a field of `ZeroConfig`.
        """
        if name not in {f.name for f in dataclasses.fields(self) if f.init}:
            raise ValueError(f"ZeroConfig.is_set(): {name!r} is not a ZeroConfig field")
        return name not in self._defaulted

    def _check_together(self) -> None:
        """The rules that tie two fields together (each field alone passed `_RULES`)."""
        pg, k = self.process_group, self.shard_group_size
        if isinstance(pg, DeviceMesh) and pg.ndim != 2:
            raise ValueError(
                f"ZeroConfig.process_group: a DeviceMesh with {pg.ndim} dimension(s) (shape "
                f"{tuple(pg.shape)}); allowed: a 2-D mesh (replicate, shard), e.g. "
                "init_device_mesh('cuda', (nodes, gpus_per_node))"
            )
        if isinstance(pg, DeviceMesh) and k is not None and k != pg.shape[1]:
            raise ValueError(
                f"ZeroConfig.shard_group_size: got {k!r} with a DeviceMesh of shape "
                f"{tuple(pg.shape)}, whose shard dimension has {pg.shape[1]} ranks; leave "
                "shard_group_size unset (None) or give the mesh's"
            )
        if self.offload == "disk" and self.offload_dir is None:
            raise ValueError(
                "ZeroConfig.offload_dir: offload='disk' needs a directory for its files; pass "
                "offload_dir=... (or set ZEROLITE_OFFLOAD_DIR)"
            )
        if self.offload_params == "disk" and self.offload_dir is None:
            raise ValueError(
                "ZeroConfig.offload_dir: offload_params='disk' needs a directory for its files; "
                "pass offload_dir=... (or set ZEROLITE_OFFLOAD_DIR)"
            )
        if self.offload_params is not None and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.offload_params: {self.offload_params!r} needs stage=3; at stage "
                f"{self.stage} every rank holds the whole parameters between steps, so there is "
                "no parameter shard to move. Use stage=3, or offload=... to move only the "
                "optimizer state"
            )
        if self.quantize_gather and self.param_dtype == torch.float16:
            raise ValueError(
                "ZeroConfig.quantize_gather: not supported with param_dtype=torch.float16 (an "
                "int8 block's scale can exceed fp16's range); use torch.bfloat16 or float32"
            )
        if self.quantize_reduce and torch.float16 in (self.param_dtype, self.grad_dtype):
            raise ValueError(
                "ZeroConfig.quantize_reduce: not supported with float16 parameters or gradients "
                "(loss scaling would leave a stale scale in the error-feedback residual); use "
                "param_dtype=torch.bfloat16 or torch.float32 and no float16 reduce_dtype"
            )

    @property
    def quantizes(self) -> bool:
        """Whether any collective is quantized (``quantize_gather`` or ``quantize_reduce``)."""
        return self.quantize_gather or self.quantize_reduce

    @property
    def grad_dtype(self) -> torch.dtype | None:
        """dtype of reduced gradient shards: ``reduce_dtype``, else ``param_dtype`` (None
        until `shard()` has chosen the model's own dtype)."""
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype

    def with_param_dtype(self, dtype: torch.dtype) -> ZeroConfig:
        """This config with its ``param_dtype=None`` filled in as ``dtype`` (checked again
        with the other fields), every other field as it is. `is_set` then says
        ``param_dtype`` was not given, since the caller left the choice to zerolite: this is
        how `shard()` records the model's own dtype and an integration its framework's
        fp16. A config whose ``param_dtype`` is ``dtype`` already is returned as it is.

        Raises:
            ValueError: ``param_dtype`` is set to another dtype; ``dtype`` is not allowed,
                or not with this config's other fields (quantized collectives refuse
                float16).
        """
        if self.param_dtype == dtype:
            return self
        if self.param_dtype is not None:
            raise ValueError(
                f"ZeroConfig.with_param_dtype({dtype}): param_dtype is {self.param_dtype} "
                "already; it fills a param_dtype of None (use dataclasses.replace to change it)"
            )
        filled = dataclasses.replace(self, param_dtype=dtype)
        object.__setattr__(filled, "_defaulted", self._defaulted | {"param_dtype"})
        return filled

    @property
    def bucket_bytes(self) -> int:
        """``bucket_size_mb`` in bytes (MiB, so 25.0 -> 26_214_400)."""
        return max(1, int(self.bucket_size_mb * 2**20))


# -- what each field allows ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One field's check: ``valid(value)``, else ``ValueError("ZeroConfig.{field}: got
    {value!r}; allowed: {allowed}")``; a valid value is stored as ``normal(value)``."""

    field: str
    valid: Callable[[Any], bool]
    allowed: str
    normal: Callable[[Any], Any] | None = None

    def check(self, value: Any) -> Any:
        if not self.valid(value):
            raise ValueError(f"ZeroConfig.{self.field}: got {value!r}; allowed: {self.allowed}")
        return value if self.normal is None else self.normal(value)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _device(v: Any) -> bool:
    if v is None:
        return True
    try:
        torch.device(v)
    except (RuntimeError, TypeError):
        return False
    return True


def _classes(v: Any, base: type) -> bool:
    return isinstance(v, tuple) and all(isinstance(c, type) and issubclass(c, base) for c in v)


def _names(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and all(isinstance(n, str) and n for n in v)


_DTYPES = f"torch.float32, torch.bfloat16, torch.float16, or a name: {accepted_names()}"
_LOW, _HIGH = QUANT_BLOCK_RANGE

# One row per field, in declaration order (a row may also normalise the value it accepts).
_RULES: tuple[_Rule, ...] = (
    _Rule("stage", lambda v: _int(v) and v in (0, 1, 2, 3),
          "0 (DDP, estimator only), 1 (optimizer state), 2 (+ gradients) and 3 (+ parameters)"),
    _Rule("param_dtype", lambda v: v is None or as_dtype(v) is not None,
          f"None (the model's own dtype), {_DTYPES}", as_dtype),
    _Rule("reduce_dtype", lambda v: v is None or as_dtype(v) is not None,
          f"None (= param_dtype), {_DTYPES}", as_dtype),
    _Rule("bucket_size_mb", lambda v: _number(v) and v > 0,
          "a finite number of MiB > 0 (floats allowed, e.g. 0.5)", float),
    _Rule("process_group", lambda v: v is None or isinstance(v, (dist.ProcessGroup, DeviceMesh)),
          "None, a torch.distributed.ProcessGroup or a 2-D DeviceMesh (replicate x shard)"),
    _Rule("device", _device, "None or a torch.device / device string such as 'cpu' or 'cuda:0'",
          lambda v: None if v is None else torch.device(v)),
    _Rule("elementwise_optimizers", lambda v: _classes(v, torch.optim.Optimizer),
          "a tuple of torch.optim.Optimizer subclasses"),
    _Rule("unit_modules",
          lambda v: v is None or callable(v) or _classes(v, torch.nn.Module),
          "None, a tuple of nn.Module classes, or a callable module -> bool"),
    _Rule("prefetch", lambda v: _int(v) and v >= 0, "an int >= 0"),
    _Rule("reshard_after_forward", _bool, "True or False"),
    _Rule("collectives", lambda v: v in COLLECTIVES, ", ".join(map(repr, COLLECTIVES))),
    _Rule("timeout_s", lambda v: _number(v) and v > 0, "a finite number of seconds > 0", float),
    _Rule("offload", lambda v: v in OFFLOAD_TIERS, "None, 'disk' or 'host'"),
    _Rule("offload_dir", lambda v: v is None or isinstance(v, (str, os.PathLike)),
          "None or a directory path", lambda v: None if v is None else os.fspath(v)),
    _Rule("offload_fraction", lambda v: _number(v) and 0 < v <= 1,
          "a number in (0, 1] (the fraction of this rank's shard whose optimizer state is "
          "offloaded)", float),
    _Rule("offload_params", lambda v: v in OFFLOAD_TIERS, "None, 'disk' or 'host'"),
    _Rule("shard_group_size", lambda v: v is None or v == "node" or (_int(v) and v >= 1),
          "None (shard over every rank), an int k >= 1 dividing the world size, or 'node' "
          "(k = LOCAL_WORLD_SIZE)"),
    _Rule("init_fn", lambda v: v is None or callable(v), "None or a callable module -> None"),
    _Rule("partition", lambda v: v in PARTITIONS, ", ".join(map(repr, PARTITIONS))),
    _Rule("quantize_gather", _bool, "True or False"),
    _Rule("quantize_reduce", _bool, "True or False"),
    _Rule("quant_block", lambda v: _int(v) and _LOW <= v <= _HIGH,
          f"an int from {_LOW} to {_HIGH}"),
    _Rule("quantize_skip", _names, "a tuple of parameter names", tuple),
    _Rule("error_feedback", _bool, "True or False"),
)
