"""ZeroConfig validation and environment-variable precedence (single process)."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from zerolite import ZeroConfig
from zerolite.ground.config_env import env_text


def test_defaults(monkeypatch):
    for var in ("ZEROLITE_STAGE", "ZEROLITE_PARAM_DTYPE", "ZEROLITE_REDUCE_DTYPE",
                "ZEROLITE_BUCKET_SIZE_MB", "ZEROLITE_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    cfg = ZeroConfig()
    # param_dtype None: the model's own dtype, decided by shard() (tests/api/test_own_dtype.py).
    assert (cfg.stage, cfg.param_dtype, cfg.reduce_dtype, cfg.bucket_size_mb) == (
        2, None, None, 25.0)
    assert cfg.process_group is None and cfg.device is None and cfg.elementwise_optimizers == ()
    assert cfg.bucket_bytes == 25 * 2**20 and cfg.grad_dtype is None
    filled = ZeroConfig(param_dtype=None).with_param_dtype(torch.bfloat16)
    assert filled.param_dtype == filled.grad_dtype == torch.bfloat16
    assert not filled.is_set("param_dtype")  # the caller left the choice to zerolite
    assert filled.with_param_dtype(torch.bfloat16) is filled
    with pytest.raises(ValueError, match="param_dtype is torch.bfloat16 already"):
        filled.with_param_dtype(torch.float32)
    with pytest.raises(ValueError, match="ZeroConfig.quantize_gather: not supported"):
        ZeroConfig(quantize_gather=True).with_param_dtype(torch.float16)  # checked again


def test_frozen_and_keyword_only():
    cfg = ZeroConfig(stage=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stage = 2
    with pytest.raises(TypeError):
        ZeroConfig(1)


def test_environment_precedence(monkeypatch):
    monkeypatch.setenv("ZEROLITE_STAGE", "1")
    monkeypatch.setenv("ZEROLITE_PARAM_DTYPE", "bf16")
    monkeypatch.setenv("ZEROLITE_BUCKET_SIZE_MB", "0.5")
    cfg = ZeroConfig()
    assert (cfg.stage, cfg.param_dtype, cfg.bucket_size_mb) == (1, torch.bfloat16, 0.5)
    explicit = ZeroConfig(stage=2, param_dtype=torch.float32)
    assert (explicit.stage, explicit.param_dtype, explicit.bucket_size_mb) == (
        2, torch.float32, 0.5)
    assert dataclasses.replace(explicit, bucket_size_mb=3).bucket_size_mb == 3.0


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(stage=4), "stage"),
        (dict(stage="2"), "stage"),
        (dict(stage=True), "stage"),
        (dict(param_dtype=torch.int8), "param_dtype"),
        (dict(reduce_dtype=torch.float64), "reduce_dtype"),
        (dict(bucket_size_mb=0), "bucket_size_mb"),
        (dict(bucket_size_mb=float("nan")), "bucket_size_mb"),
        (dict(process_group="world"), "process_group"),
        (dict(device="nonsense"), "device"),
        (dict(elementwise_optimizers=[torch.optim.SGD]), "elementwise_optimizers"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"ZeroConfig.{field}"):
        ZeroConfig(**kwargs)


def test_invalid_environment_value_names_the_field(monkeypatch):
    monkeypatch.setenv("ZEROLITE_STAGE", "two")
    with pytest.raises(ValueError, match="ZeroConfig.stage.*'two'"):
        ZeroConfig()
    monkeypatch.setenv("ZEROLITE_STAGE", "7")
    with pytest.raises(ValueError, match="ZeroConfig.stage: got 7"):
        ZeroConfig()


def test_is_set_tells_given_fields_from_defaults(monkeypatch):
    monkeypatch.delenv("ZEROLITE_PARAM_DTYPE", raising=False)
    monkeypatch.setenv("ZEROLITE_STAGE", "3")
    cfg = ZeroConfig(bucket_size_mb=1)
    assert cfg.is_set("bucket_size_mb") and cfg.is_set("stage")  # argument; environment
    assert not cfg.is_set("param_dtype")
    assert ZeroConfig(param_dtype=None).is_set("param_dtype")  # explicit default value
    assert cfg == ZeroConfig(bucket_size_mb=1, param_dtype=None)  # not part of equality
    with pytest.raises(ValueError, match="'nosuch' is not a ZeroConfig field"):
        cfg.is_set("nosuch")


def test_integrations_fill_only_an_unset_param_dtype(monkeypatch):
    """Accelerate's ``mixed_precision='bf16'`` and a Trainer's ``args.bf16`` leave
    ``param_dtype`` None, the model's own dtype (an fp32 model: the host framework's recipe,
    its autocast computes in bf16), unless the config (argument or ZEROLITE_PARAM_DTYPE) asks
    for zerolite's bf16 parameters."""
    from types import SimpleNamespace

    from zerolite.accelerate import zero_config_for
    from zerolite.hf import zero_config_for_args

    monkeypatch.delenv("ZEROLITE_PARAM_DTYPE", raising=False)
    bf16 = SimpleNamespace(mixed_precision="bf16", device=torch.device("cpu"))
    args = SimpleNamespace(bf16=True, fp16=False, device=torch.device("cpu"))
    assert zero_config_for(bf16, ZeroConfig(stage=3)).param_dtype is None
    assert zero_config_for(bf16, None).param_dtype is None
    assert zero_config_for_args(args, None).param_dtype is None
    explicit = ZeroConfig(stage=3, param_dtype=torch.bfloat16)  # zerolite's 16-bit recipe
    assert zero_config_for(bf16, explicit).param_dtype == torch.bfloat16
    assert zero_config_for_args(args, explicit).param_dtype == torch.bfloat16
    monkeypatch.setenv("ZEROLITE_PARAM_DTYPE", "bf16")
    assert zero_config_for(bf16, ZeroConfig(stage=3)).param_dtype == torch.bfloat16
    assert zero_config_for_args(args, None).param_dtype == torch.bfloat16


def test_stages_compose():
    """The stage table: each stage shards what the one before does, plus the next kind."""
    from zerolite.plan.stages import STAGES

    kinds = ("shards_optimizer_state", "shards_gradients", "shards_parameters")
    assert sorted(STAGES) == [0, 1, 2, 3]
    for stage, policy in STAGES.items():
        assert policy.stage == stage and ZeroConfig(stage=stage).stage == stage
        assert [getattr(policy, kind) for kind in kinds] == [i < stage for i in range(3)], stage
        kept = policy.kept_grad_dtype(torch.bfloat16, torch.float32)
        assert kept == (torch.float32 if policy.shards_gradients else torch.bfloat16)


# Every ZEROLITE_* variable the docs name: (field, text, what it parses to, an explicit
# argument that must win over it, a text that must be refused naming the field). Written
# out here, not read from ZeroConfig's fields, so that a parser that changes behaviour
# (or a variable that stops being read) fails.
ENV_CASES = {
    "ZEROLITE_STAGE": ("stage", " 1 ", 1, 3, "two"),
    "ZEROLITE_PARAM_DTYPE": ("param_dtype", "BF16", torch.bfloat16, torch.float32, "int8"),
    "ZEROLITE_REDUCE_DTYPE": ("reduce_dtype", "torch.float32", torch.float32, torch.bfloat16,
                              "double"),
    "ZEROLITE_BUCKET_SIZE_MB": ("bucket_size_mb", "0.5", 0.5, 3.0, "-1"),
    "ZEROLITE_DEVICE": ("device", "cpu", torch.device("cpu"), torch.device("meta"), "nonsense"),
    "ZEROLITE_PREFETCH": ("prefetch", "2", 2, 0, "-1"),
    "ZEROLITE_RESHARD_AFTER_FORWARD": ("reshard_after_forward", "off", False, True, "maybe"),
    "ZEROLITE_COLLECTIVES": ("collectives", " NATIVE", "native", "point_to_point", "mpi"),
    "ZEROLITE_TIMEOUT_S": ("timeout_s", "12.5", 12.5, 3.0, "soon"),
    "ZEROLITE_PARTITION": ("partition", "Tensor", "tensor", "flat", "rows"),
    "ZEROLITE_OFFLOAD": ("offload", "HOST", "host", None, "nvme"),
    "ZEROLITE_OFFLOAD_DIR": ("offload_dir", "/scratch/zl", "/scratch/zl", "/elsewhere", None),
    "ZEROLITE_OFFLOAD_FRACTION": ("offload_fraction", "0.25", 0.25, 1.0, "1.5"),
    "ZEROLITE_OFFLOAD_PARAMS": ("offload_params", " Host", "host", None, "nvme"),
    "ZEROLITE_QUANTIZE_GATHER": ("quantize_gather", "yes", True, False, "sometimes"),
    "ZEROLITE_QUANTIZE_REDUCE": ("quantize_reduce", "1", True, False, "2"),
    "ZEROLITE_QUANT_BLOCK": ("quant_block", "128", 128, 64, "8"),
    "ZEROLITE_QUANTIZE_SKIP": ("quantize_skip", " head.weight, ln_f.bias ,", ("head.weight",
                                                                              "ln_f.bias"),
                               ("wte.weight",), None),
    "ZEROLITE_ERROR_FEEDBACK": ("error_feedback", "false", False, True, "no way"),
    "ZEROLITE_SHARD_GROUP_SIZE": ("shard_group_size", "node", "node", 4, "two"),
}
# Texts meaning "unset" for the variables whose default is None.
ENV_NONE = {"ZEROLITE_PARAM_DTYPE": "none", "ZEROLITE_REDUCE_DTYPE": "none",
            "ZEROLITE_OFFLOAD": "None", "ZEROLITE_OFFLOAD_PARAMS": "none",
            "ZEROLITE_OFFLOAD_DIR": "", "ZEROLITE_SHARD_GROUP_SIZE": "none"}


# What a variable needs from the others to be valid at all (offload_params: stage 3).
ENV_NEEDS = {"ZEROLITE_OFFLOAD_PARAMS": {"ZEROLITE_STAGE": "3"}}


def _clear_env(monkeypatch, var: str | None = None) -> None:
    for name in ENV_CASES:
        monkeypatch.delenv(name, raising=False)
    for name, text in ENV_NEEDS.get(var, {}).items():
        monkeypatch.setenv(name, text)


def test_every_environment_variable_is_documented_and_tested():
    """The variables zerolite reads are exactly those tested here, and the docs name each
    (docs/training-loops.md, where ZeroConfig's precedence is explained)."""
    variables = {f.metadata["env"] for f in dataclasses.fields(ZeroConfig) if "env" in f.metadata}
    assert variables == set(ENV_CASES)
    page = (Path(__file__).resolve().parents[2] / "docs" / "training-loops.md").read_text()
    assert [var for var in ENV_CASES if f"`{var}" not in page] == []


@pytest.mark.parametrize("var", list(ENV_CASES))
def test_environment_variable_parsing_and_precedence(monkeypatch, var):
    """Its text is parsed (whitespace and case forgiven where the docs' examples allow), an
    explicit argument beats it, without it the default holds (and is_set says so), and a
    bad text raises a ValueError naming the field and the text."""
    field, text, parsed, explicit, bad = ENV_CASES[var]
    _clear_env(monkeypatch, var)
    default = getattr(ZeroConfig(), field)
    assert not ZeroConfig().is_set(field)
    monkeypatch.setenv(var, text)
    cfg = ZeroConfig()
    assert getattr(cfg, field) == parsed and cfg.is_set(field), (var, getattr(cfg, field))
    assert getattr(ZeroConfig(**{field: explicit}), field) == explicit
    assert getattr(ZeroConfig(**{field: default}), field) == default  # the default, explicitly
    if var in ENV_NONE:
        monkeypatch.setenv(var, ENV_NONE[var])
        assert getattr(ZeroConfig(), field) is None
    if bad is not None:
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=rf"ZeroConfig\.{field}\b.*{re.escape(bad.strip())}"):
            ZeroConfig()
    monkeypatch.delenv(var)
    assert getattr(ZeroConfig(), field) == default


def test_environment_fills_only_fields_not_passed(monkeypatch):
    """Several variables at once: each fills its own field, arguments override field by
    field, and a variable needing another (offload="disk" needs a directory) is checked
    against the other's variable."""
    _clear_env(monkeypatch)
    monkeypatch.setenv("ZEROLITE_STAGE", "3")
    monkeypatch.setenv("ZEROLITE_OFFLOAD", "disk")
    with pytest.raises(ValueError, match="ZeroConfig.offload_dir: offload='disk' needs"):
        ZeroConfig()
    monkeypatch.setenv("ZEROLITE_OFFLOAD_DIR", "/tmp")
    cfg = ZeroConfig(offload_fraction=0.5)
    assert (cfg.stage, cfg.offload, cfg.offload_dir, cfg.offload_fraction) == (3, "disk", "/tmp",
                                                                              0.5)
    assert ZeroConfig(offload=None).offload is None  # an explicit None beats the variable
    monkeypatch.setenv("ZEROLITE_PARAM_DTYPE", "fp16")
    monkeypatch.setenv("ZEROLITE_QUANTIZE_GATHER", "1")
    with pytest.raises(ValueError, match="ZeroConfig.quantize_gather: not supported with "
                                         "param_dtype=torch.float16"):
        ZeroConfig()
    assert ZeroConfig(param_dtype=torch.bfloat16).quantize_gather


# The names a user writes for each dtype (Accelerate's, transformers', torch's), written out
# here rather than read from zerolite's table, so a name that stops being read fails.
DTYPE_NAMES = {
    torch.float32: ("fp32", "float32", "float", "FP32", "torch.float32"),
    torch.bfloat16: ("bf16", "bfloat16", " BF16 ", "torch.bfloat16"),
    torch.float16: ("fp16", "float16", "half", "Float16"),
}


@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=str)
def test_dtype_names_are_accepted_wherever_a_dtype_is(monkeypatch, dtype):
    """A name is stored as the torch.dtype, as an argument of either dtype field and as
    either variable (the one table): the config equals the one given the dtype itself."""
    _clear_env(monkeypatch)
    for name in DTYPE_NAMES[dtype]:
        cfg = ZeroConfig(param_dtype=name, reduce_dtype=name)
        assert cfg.param_dtype is dtype and cfg.reduce_dtype is dtype, name
        assert cfg == ZeroConfig(param_dtype=dtype, reduce_dtype=dtype)
        assert dataclasses.replace(ZeroConfig(), param_dtype=name).param_dtype is dtype
        monkeypatch.setenv("ZEROLITE_PARAM_DTYPE", name)
        monkeypatch.setenv("ZEROLITE_REDUCE_DTYPE", name)
        assert (ZeroConfig().param_dtype, ZeroConfig().reduce_dtype) == (dtype, dtype), name
    assert ZeroConfig(param_dtype=None).with_param_dtype(dtype).param_dtype is dtype


@pytest.mark.parametrize("bad", ["float64", "double", "int8", "bf 16", "", "torch", 16])
def test_a_bad_dtype_name_lists_the_accepted_names(monkeypatch, bad):
    _clear_env(monkeypatch)
    for field in ("param_dtype", "reduce_dtype"):
        with pytest.raises(ValueError, match=rf"ZeroConfig\.{field}: got {re.escape(repr(bad))}"
                                             r"; allowed: ") as exc:
            ZeroConfig(**{field: bad})
        listed = str(exc.value).split("; allowed: ")[1]
        assert all(n in listed for n in ("torch.bfloat16", "'bf16'", "'float32'", "'half'"))
    if isinstance(bad, str) and bad.strip():
        monkeypatch.setenv("ZEROLITE_PARAM_DTYPE", bad)
        with pytest.raises(ValueError, match=rf"ZeroConfig\.param_dtype: environment value "
                                             rf"{re.escape(repr(bad))} is not a dtype; use one "
                                             r"of .*'bf16'"):
            ZeroConfig()


@pytest.mark.parametrize("var", list(ENV_CASES))
def test_env_text_reads_back_as_the_value(monkeypatch, var):
    """`env_text` (what ``zerolite plan`` prints for ``accelerate launch``) of each field's
    value is a text its variable's parser reads back to the same value; None included."""
    field, _, parsed, explicit, _ = ENV_CASES[var]
    values = [parsed, explicit] + ([None] if var in ENV_NONE else [])
    for value in values:
        _clear_env(monkeypatch, var)
        if field == "offload_dir":
            monkeypatch.setenv("ZEROLITE_OFFLOAD", "none")
        monkeypatch.setenv(var, env_text(value))
        assert getattr(ZeroConfig(), field) == value, (var, value, env_text(value))
    with pytest.raises(ValueError, match="no ZEROLITE_"):
        env_text(object())
