"""`ZeroConfig`: what `zerolite.shard` builds, validated once, frozen.

Precedence, field by field: an explicit argument beats a ``ZEROLITE_*`` environment
variable, which beats the default. Fields the user did not pass are resolved in
``__post_init__``, so ``ZeroConfig()`` read inside a job launched with
``ZEROLITE_STAGE=1`` is a stage-1 config, while ``ZeroConfig(stage=2)`` stays stage 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from zerolite.config_env import (
    ALLOWED_DTYPES,
    COLLECTIVES,
    ENV_FIELDS,
    OFFLOAD_TIERS,
    PARTITIONS,
    QUANT_BLOCK_RANGE,
    UNSET,
)

__all__ = ["ZeroConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """How `zerolite.shard` shards a model and its optimizer.

    Args:
        stage: 1 shards optimizer state (fp32 masters and moments); 2 also shards
            gradients, reduce-scattered during backward; 3 also shards parameters,
            all-gathered per unit just before use. 0 means plain DDP and is only
            meaningful to the memory estimator: `shard()` rejects it. Env: ``ZEROLITE_STAGE``.
        param_dtype: dtype of the compute copy of every managed parameter. The fp32
            master is this rank's shard: with ``torch.float32`` it is the parameter
            storage itself (no second copy). Env: ``ZEROLITE_PARAM_DTYPE`` (``bf16``...).
        reduce_dtype: dtype in which gradients are reduced and their shards kept;
            ``None`` means ``param_dtype``. Env: ``ZEROLITE_REDUCE_DTYPE``.
        bucket_size_mb: size of a flat buffer (and so of one reduce-scatter / all-gather)
            in MiB of ``param_dtype`` elements; a parameter larger than this gets a
            buffer of its own. Env: ``ZEROLITE_BUCKET_SIZE_MB``.
        process_group: the data-parallel group; ``None`` is the default group (or a
            single process when ``torch.distributed`` is not initialised). A 2-D
            ``torch.distributed.device_mesh.DeviceMesh`` (replicate x shard) shards along
            its second dimension and replicates along its first (hybrid sharding, see
            ``shard_group_size``).
        device: where flat buffers live; ``None`` keeps the parameters' own device (a model
            built on the meta device: the process group's CUDA device under NCCL -- its
            bound ``device_id``, else the current CUDA device -- otherwise the CPU; see
            `zerolite.comm.devices`). ``"cuda"`` means the current CUDA device at `shard()`.
            Env: ``ZEROLITE_DEVICE``.
        elementwise_optimizers: optimizer classes, beyond zerolite's allow-list, that
            the user declares elementwise (their update of an element depends only on
            that element's own gradient and state), so stepping 1-D shards is exact.
        unit_modules: stage 3: which modules are gathered together as one unit. ``None``
            makes each element of every ``nn.ModuleList`` a unit; a tuple of module
            classes, or a callable ``module -> bool``, picks them instead. The root
            module is always a unit, holding every parameter no other unit holds.
        prefetch: stage 3: units whose all-gather starts ahead of use (next units in
            forward, previous ones in backward). Env: ``ZEROLITE_PREFETCH``.
        reshard_after_forward: stage 3: free each unit's full parameters after its
            forward (and gather again for backward). The root unit stays gathered from
            forward to backward either way. ``False`` also keeps units gathered after a
            forward without gradients (evaluation, a ``generate()`` loop: no gather per
            token) until the next backward ends; a step's updates are gathered again
            before the next use. Env: ``ZEROLITE_RESHARD_AFTER_FORWARD``.
        collectives: how reduce-scatters and all-gathers travel. ``"native"``:
            torch.distributed's own kernels (what NCCL runs); ``"point_to_point"``: built
            from ``isend``/``irecv``, each exchange tagged with its sequence number (gloo has
            a slow all-gather and runs reduce-scatter as a full all-reduce); ``"auto"``
            (default): point-to-point on gloo, native otherwise. Env: ``ZEROLITE_COLLECTIVES``.
        timeout_s: seconds any zerolite collective over gloo may wait for the other ranks
            before it raises `zerolite.CollectiveTimeout` naming the operation and the step
            (a rank that skipped ``step()``, saved alone or died). Not used on NCCL: there a
            wait with a timeout would block the host until the kernel finished, so zerolite
            waits without one (the current CUDA stream waits for the exchange) and the
            bound is the process group's own timeout (``init_process_group(timeout=...)``),
            enforced by NCCL's watchdog. Env: ``ZEROLITE_TIMEOUT_S``.
        offload: where this rank's share of the optimizer state lives (its moments, and
            the fp32 masters when parameters are 16-bit; fp32 masters are the parameters
            and stay): ``None`` (default) in compute memory; ``"disk"``: a preallocated
            file per rank under ``offload_dir``; ``"host"``: pinned host memory for a CUDA
            model (a separate host arena on CPU). The step streams it through in chunks
            (see `zerolite.optim.streamed_step`). Env: ``ZEROLITE_OFFLOAD``.
        offload_dir: ``"disk"``: an existing, writable directory for the files (removed
            when the model is garbage-collected or the process exits). Env:
            ``ZEROLITE_OFFLOAD_DIR``.
        offload_fraction: the fraction, in (0, 1], of this rank's shard elements whose
            state is offloaded, rounded up to whole parameter pieces (the first pieces in
            layout order). Env: ``ZEROLITE_OFFLOAD_FRACTION``.
        shard_group_size: hybrid sharding (`zerolite.comm.hybrid`). ``None``: shard over the
            whole data-parallel group. An int k: shard within consecutive groups of k ranks
            (ranks 0..k-1, k..2k-1, ...) and replicate across the groups; gradients are
            reduce-scattered within a group, then each shard is all-reduced across the
            groups. ``"node"``: k = ``LOCAL_WORLD_SIZE`` (shard within a machine). k must
            divide the world size. Env: ``ZEROLITE_SHARD_GROUP_SIZE`` (``none``, ``node``, k).
        init_fn: for a model built under ``torch.device("meta")`` only: called as
            ``init_fn(module)`` on every module (children before parents, as
            ``nn.Module.apply``) once its parameters have storage, instead of each
            module's own ``reset_parameters()``. It must draw from the default generator
            only, so every rank computes the same values (see `zerolite.params.meta_init`).
        partition: how trained parameters are split over ranks (see `zerolite.plan.owners`).
            ``"flat"``: every flat buffer in equal 1-D shards (elementwise optimizers only).
            ``"tensor"``: each parameter whole on one owner rank, which steps it in its own
            shape, so any optimizer that steps tensor by tensor works (Muon, Adafactor).
            ``"auto"`` (default): ``"flat"`` when every optimizer is elementwise (exactly
            what zerolite did before this option), ``"tensor"`` otherwise. Stages 1-2.
            Env: ``ZEROLITE_PARTITION``.
        quantize_gather: every parameter all-gather (stage 3's unit gathers, stages 1-2's
            post-step publish) sends int8 blocks of ``quant_block`` elements with one fp32
            scale each; every rank, the owner included, computes with the same dequantized
            values, and the fp32 masters stay exact (`zerolite.comm.codec`). Refused with
            fp16 parameters. Env: ``ZEROLITE_QUANTIZE_GATHER``.
        quantize_reduce: every gradient reduce-scatter sends each rank's contribution as
            int8 blocks; receivers dequantize and sum in fp32 in rank order. Refused with
            fp16 gradients (loss-scaled residuals). Env: ``ZEROLITE_QUANTIZE_REDUCE``.
        quant_block: elements per quantization block (16 to 2**20). Env:
            ``ZEROLITE_QUANT_BLOCK``.
        quantize_skip: names of parameters (as ``model.named_parameters()`` spells them)
            that always travel unquantized; parameters of fewer than ``quant_block``
            elements do too. Env: ``ZEROLITE_QUANTIZE_SKIP`` (comma-separated).
        error_feedback: with ``quantize_reduce``, keep each rank's quantization error
            (fp32, (N-1)/N of the gradient buffers per rank) and add it to the next
            exchange's contribution; ``False`` saves that memory at an accuracy cost
            (README, "Quantized collectives"). Env: ``ZEROLITE_ERROR_FEEDBACK``.

    Raises:
        ValueError: a field (or its environment variable) holds an invalid value; the
            message names the field, the value and what is allowed.
    """

    stage: int = UNSET
    param_dtype: torch.dtype = UNSET
    reduce_dtype: torch.dtype | None = UNSET
    bucket_size_mb: float = UNSET
    process_group: dist.ProcessGroup | DeviceMesh | None = None
    device: torch.device | None = UNSET
    elementwise_optimizers: tuple[type[torch.optim.Optimizer], ...] = ()
    unit_modules: tuple[type[torch.nn.Module], ...] | Callable[[torch.nn.Module], bool] | None = (
        None
    )
    prefetch: int = UNSET
    reshard_after_forward: bool = UNSET
    collectives: str = UNSET
    timeout_s: float = UNSET
    offload: str | None = UNSET
    offload_dir: str | None = UNSET
    offload_fraction: float = UNSET
    shard_group_size: int | str | None = UNSET
    init_fn: Callable[[torch.nn.Module], None] | None = None
    partition: str = UNSET
    quantize_gather: bool = UNSET
    quantize_reduce: bool = UNSET
    quant_block: int = UNSET
    quantize_skip: tuple[str, ...] = UNSET
    error_feedback: bool = UNSET
    # Fields with environment variables that took their default (no argument, no variable):
    # integrations may fill those from their own settings (Accelerate's mixed_precision).
    _defaulted: frozenset[str] = dataclasses.field(
        default=frozenset(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        defaulted = set()
        for name, (env, parse, default) in ENV_FIELDS.items():
            if getattr(self, name) is UNSET:
                raw = os.environ.get(env)
                object.__setattr__(self, name, default if raw is None else parse(raw))
                if raw is None:
                    defaulted.add(name)
        object.__setattr__(self, "_defaulted", frozenset(defaulted))
        self._validate()

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

    def _validate(self) -> None:
        if (
            isinstance(self.stage, bool)
            or not isinstance(self.stage, int)
            or self.stage not in (0, 1, 2, 3)
        ):
            raise ValueError(
                f"ZeroConfig.stage: got {self.stage!r}; allowed values are 0 (DDP, estimator "
                "only), 1 (optimizer state), 2 (+ gradients) and 3 (+ parameters)"
            )
        if self.param_dtype not in ALLOWED_DTYPES:
            raise ValueError(
                f"ZeroConfig.param_dtype: got {self.param_dtype!r}; allowed: torch.float32, "
                "torch.bfloat16, torch.float16"
            )
        if self.reduce_dtype is not None and self.reduce_dtype not in ALLOWED_DTYPES:
            raise ValueError(
                f"ZeroConfig.reduce_dtype: got {self.reduce_dtype!r}; allowed: None (= "
                f"param_dtype), torch.float32, torch.bfloat16, torch.float16"
            )
        size = self.bucket_size_mb
        if (
            isinstance(size, bool)
            or not isinstance(size, (int, float))
            or not math.isfinite(size)
            or size <= 0
        ):
            raise ValueError(
                f"ZeroConfig.bucket_size_mb: got {size!r}; allowed: a finite number of MiB > 0 "
                "(floats allowed, e.g. 0.5)"
            )
        object.__setattr__(self, "bucket_size_mb", float(size))
        pg = self.process_group
        if pg is not None and not isinstance(pg, (dist.ProcessGroup, DeviceMesh)):
            raise ValueError(
                f"ZeroConfig.process_group: got {type(pg).__name__}; allowed: None, a "
                "torch.distributed.ProcessGroup or a 2-D DeviceMesh (replicate x shard)"
            )
        k = self.shard_group_size
        whole = isinstance(k, int) and not isinstance(k, bool)
        if k is not None and k != "node" and not (whole and k >= 1):
            raise ValueError(
                f"ZeroConfig.shard_group_size: got {k!r}; allowed: None (shard over every rank), "
                "an int k >= 1 dividing the world size, or 'node' (k = LOCAL_WORLD_SIZE)"
            )
        if isinstance(pg, DeviceMesh):
            if pg.ndim != 2:
                raise ValueError(
                    f"ZeroConfig.process_group: a DeviceMesh with {pg.ndim} dimension(s) (shape "
                    f"{tuple(pg.shape)}); allowed: a 2-D mesh (replicate, shard), e.g. "
                    "init_device_mesh('cuda', (nodes, gpus_per_node))"
                )
            if k is not None and k != pg.shape[1]:
                raise ValueError(
                    f"ZeroConfig.shard_group_size: got {k!r} with a DeviceMesh of shape "
                    f"{tuple(pg.shape)}, whose shard dimension has {pg.shape[1]} ranks; leave "
                    "shard_group_size unset (None) or give the mesh's"
                )
        if self.device is not None:
            try:
                object.__setattr__(self, "device", torch.device(self.device))
            except (RuntimeError, TypeError):
                raise ValueError(
                    f"ZeroConfig.device: got {self.device!r}; allowed: None or a torch.device / "
                    "device string such as 'cpu' or 'cuda:0'"
                ) from None
        um = self.unit_modules
        if (
            um is not None
            and not callable(um)
            and not (
                isinstance(um, tuple)
                and all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in um)
            )
        ):
            raise ValueError(
                f"ZeroConfig.unit_modules: got {um!r}; allowed: None, a tuple of nn.Module "
                "classes, or a callable module -> bool"
            )
        if (
            isinstance(self.prefetch, bool)
            or not isinstance(self.prefetch, int)
            or self.prefetch < 0
        ):
            raise ValueError(f"ZeroConfig.prefetch: got {self.prefetch!r}; allowed: an int >= 0")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(
                f"ZeroConfig.reshard_after_forward: got {self.reshard_after_forward!r}; allowed: "
                f"True or False"
            )
        if self.collectives not in COLLECTIVES:
            raise ValueError(
                f"ZeroConfig.collectives: got {self.collectives!r}; allowed: "
                + ", ".join(repr(c) for c in COLLECTIVES)
            )
        if self.partition not in PARTITIONS:
            raise ValueError(
                f"ZeroConfig.partition: got {self.partition!r}; allowed: "
                + ", ".join(repr(c) for c in PARTITIONS)
            )
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(
                f"ZeroConfig.timeout_s: got {t!r}; allowed: a finite number of seconds > 0"
            )
        object.__setattr__(self, "timeout_s", float(t))
        self._validate_offload()
        if self.init_fn is not None and not callable(self.init_fn):
            raise ValueError(
                f"ZeroConfig.init_fn: got {self.init_fn!r}; allowed: None or a callable module -> "
                f"None"
            )
        eo = self.elementwise_optimizers
        if not isinstance(eo, tuple) or not all(
            isinstance(c, type) and issubclass(c, torch.optim.Optimizer) for c in eo
        ):
            raise ValueError(
                f"ZeroConfig.elementwise_optimizers: got {eo!r}; allowed: a tuple of "
                "torch.optim.Optimizer subclasses"
            )
        self._validate_quantization()

    def _validate_quantization(self) -> None:
        for name in ("quantize_gather", "quantize_reduce", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"ZeroConfig.{name}: got {getattr(self, name)!r}; allowed: True or False"
                )
        low, high = QUANT_BLOCK_RANGE
        block = self.quant_block
        if isinstance(block, bool) or not isinstance(block, int) or not low <= block <= high:
            raise ValueError(
                f"ZeroConfig.quant_block: got {block!r}; allowed: an int from {low} to {high}"
            )
        skip = self.quantize_skip
        if isinstance(skip, str) or not isinstance(skip, (tuple, list)) or not all(
            isinstance(n, str) and n for n in skip
        ):
            raise ValueError(
                f"ZeroConfig.quantize_skip: got {skip!r}; allowed: a tuple of parameter names"
            )
        object.__setattr__(self, "quantize_skip", tuple(skip))
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

    def _validate_offload(self) -> None:
        if self.offload not in OFFLOAD_TIERS:
            raise ValueError(
                f"ZeroConfig.offload: got {self.offload!r}; allowed: None, 'disk' or 'host'"
            )
        if self.offload_dir is not None:
            if not isinstance(self.offload_dir, (str, os.PathLike)):
                raise ValueError(
                    f"ZeroConfig.offload_dir: got {self.offload_dir!r}; allowed: None or a "
                    "directory path"
                )
            object.__setattr__(self, "offload_dir", os.fspath(self.offload_dir))
        if self.offload == "disk" and self.offload_dir is None:
            raise ValueError(
                "ZeroConfig.offload_dir: offload='disk' needs a directory for its files; pass "
                "offload_dir=... (or set ZEROLITE_OFFLOAD_DIR)"
            )
        f = self.offload_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(
                f"ZeroConfig.offload_fraction: got {f!r}; allowed: a number in (0, 1] (the "
                "fraction of this rank's shard whose optimizer state is offloaded)"
            )
        object.__setattr__(self, "offload_fraction", float(f))

    @property
    def grad_dtype(self) -> torch.dtype:
        """dtype of reduced gradient shards: ``reduce_dtype``, else ``param_dtype``."""
        return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype

    @property
    def bucket_bytes(self) -> int:
        """``bucket_size_mb`` in bytes (MiB, so 25.0 -> 26_214_400)."""
        return max(1, int(self.bucket_size_mb * 2**20))
