"""ZeroConfig validation and environment-variable precedence (single process)."""

import dataclasses

import pytest
import torch

from zerolite import ZeroConfig


def test_defaults(monkeypatch):
    for var in ("ZEROLITE_STAGE", "ZEROLITE_PARAM_DTYPE", "ZEROLITE_REDUCE_DTYPE",
                "ZEROLITE_BUCKET_SIZE_MB", "ZEROLITE_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    cfg = ZeroConfig()
    assert (cfg.stage, cfg.param_dtype, cfg.reduce_dtype, cfg.bucket_size_mb) == (
        2, torch.float32, None, 25.0)
    assert cfg.process_group is None and cfg.device is None and cfg.elementwise_optimizers == ()
    assert cfg.bucket_bytes == 25 * 2**20 and cfg.grad_dtype == torch.float32


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
    assert ZeroConfig(param_dtype=torch.float32).is_set("param_dtype")  # explicit default value
    assert cfg == ZeroConfig(bucket_size_mb=1, param_dtype=torch.float32)  # not part of equality
    with pytest.raises(ValueError, match="'nosuch' is not a ZeroConfig field"):
        cfg.is_set("nosuch")


def test_integrations_fill_only_an_unset_param_dtype(monkeypatch):
    """Accelerate's mixed_precision and a Trainer's args.bf16 choose param_dtype unless the
    config (argument or ZEROLITE_PARAM_DTYPE) says otherwise."""
    from types import SimpleNamespace

    from zerolite.accelerate import zero_config_for

    monkeypatch.delenv("ZEROLITE_PARAM_DTYPE", raising=False)
    bf16 = SimpleNamespace(mixed_precision="bf16", device=torch.device("cpu"))
    assert zero_config_for(bf16, ZeroConfig(stage=3)).param_dtype == torch.bfloat16
    assert zero_config_for(bf16, None).param_dtype == torch.bfloat16
    assert (
        zero_config_for(bf16, ZeroConfig(stage=3, param_dtype=torch.float32)).param_dtype
        == torch.float32
    )
    monkeypatch.setenv("ZEROLITE_PARAM_DTYPE", "fp32")
    assert zero_config_for(bf16, ZeroConfig(stage=3)).param_dtype == torch.float32


def test_stages_compose():
    """The stage table: each stage shards what the one before does, plus the next kind."""
    from zerolite.stages import STAGES

    kinds = ("shards_optimizer_state", "shards_gradients", "shards_parameters")
    assert sorted(STAGES) == [0, 1, 2, 3]
    for stage, policy in STAGES.items():
        assert policy.stage == stage and ZeroConfig(stage=stage).stage == stage
        assert [getattr(policy, kind) for kind in kinds] == [i < stage for i in range(3)], stage
        kept = policy.grad_dtype(torch.bfloat16, torch.float32)
        assert kept == (torch.float32 if policy.shards_gradients else torch.bfloat16)
