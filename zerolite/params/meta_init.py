"""Meta-device builds: parameters get storage one stage-3 unit at a time.

A model built under ``with torch.device("meta"):`` has shapes but no storage, so even a
model far larger than one rank costs nothing to construct. `zerolite.shard` then
materialises it on ``ZeroConfig.device``:

1. every rank adopts rank 0's random generator states (CPU, and the device's own), so
   every rank computes the same values and none needs to be broadcast;
2. modules are visited children first (``nn.Module.apply`` order). Reaching a module
   with a parameter of a not yet materialised unit allocates that unit's full flat
   buffer, filled with NaN; the module is then initialised by ``ZeroConfig.init_fn``
   if given, else by its own ``reset_parameters()``. Once the unit's own module has been
   visited, its parameters are checked and (stage 3) only this rank's shard is kept.
   The root unit (embeddings, head, final norm) stays full to the end, so the root and
   one other unit are the only full units at any time. Stages 1-2 keep every buffer full
   anyway;
3. a floating tensor still holding NaN afterwards was not initialised by anything (a
   module without ``reset_parameters()``, such as transformers' ``Conv1D``). Parameters
   and persistent buffers among them are recorded: `zerolite.checkpoint.load_pretrained`
   or `zerolite.checkpoint.load` must write them before the first forward, which
   otherwise raises naming them. Non-persistent buffers cannot be loaded, so they go
   back to the meta device, and the first forward raises naming them unless the user
   assigned them meanwhile. An integer buffer counts as initialised when its module's
   initialiser ran (it starts at zero).

Parameters keep their identity (``torch.utils.swap_tensors``): the optimizer built on the
meta model, tied weights and attributes set on parameters stay valid.

[Note: equal to a normal build]
torch's layers (``Linear``, ``Embedding``, ``LayerNorm``, ``Conv*``, ...) call
``reset_parameters()`` at the end of their ``__init__``, so a normal build draws their
values in construction order; zerolite calls them children first in registration order,
which is the same order when each module is created where it is assigned. A tied
parameter keeps the values its first holder (in registration order) gives it; later
holders still draw, into a scratch copy, as a normal build's ``self.head.weight =
self.wte.weight`` after construction discards theirs. So if

- every module with parameters or buffers sets all of them in its ``reset_parameters()``,
  and its ``__init__`` does nothing else with random numbers (a model-wide
  ``self.apply(init)`` in ``__init__`` breaks this: pass ``init_fn`` instead, which gives
  a deterministic build equal across world sizes, but not equal to the normal one), and
- submodules are assigned as they are created (``self.a = A(); self.b = B()``),

then ``torch.manual_seed(s)``, the model built on meta and sharded gives, bit for bit,
the parameters of ``torch.manual_seed(s)``, the model built normally on
``ZeroConfig.device`` and sharded (zerolite's normal path takes rank 0's values). Rank
0's generator ends where a normal build leaves it; other ranks' generators are left
untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
from torch import nn

from zerolite import phase_events
from zerolite.comm.collectives import Group
from zerolite.comm.small_exchange import exchange_small
from zerolite.params.flat_buffer import FlatParamBuffer

__all__ = [
    "MetaBuild",
    "check_before_first_forward",
    "materialize",
]

@dataclasses.dataclass
class MetaBuild:
    """What a meta build left for the user to fill before the first forward.

    ``uninitialised`` maps state-dict names of parameters and persistent buffers that
    nothing initialised to ``"parameter"`` or ``"buffer"``; loading removes them.
    """

    uninitialised: dict[str, str]
    handle: torch.utils.hooks.RemovableHandle | None = None
    checked: bool = False  # the first forward passed `check`

    def loaded(self, names: list[str] | None) -> None:
        """Loading wrote ``names`` (``None``: every parameter and persistent buffer)."""
        if names is None:
            self.uninitialised.clear()
        for name in names or []:
            self.uninitialised.pop(name, None)

    def check(self, model: nn.Module) -> None:
        """Raise if anything is still uninitialised; called by the first forward."""
        left_on_meta = [name for name, b in model.named_buffers() if b.is_meta]
        if self.uninitialised:
            names = sorted(self.uninitialised)
            raise RuntimeError(
                f"{len(names)} tensors of this model were built on the meta device and nothing "
                f"initialised them (their modules have no reset_parameters() and "
                f"ZeroConfig.init_fn did not set them): "
                f"{names[:8]}{' ...' if len(names) > 8 else ''}. Load them before the first "
                f"forward with zerolite.checkpoint.load_pretrained(model, files) (or "
                f"zerolite.checkpoint.load), or pass ZeroConfig(init_fn=...) that initialises them."
            )
        if left_on_meta:
            raise RuntimeError(
                f"non-persistent buffers were left on the meta device by the meta build: "
                f"{left_on_meta[:8]}. They are not in any checkpoint, so compute them in the "
                "module's reset_parameters() or in ZeroConfig.init_fn, or assign them "
                "(module.name = tensor) before the first forward."
            )
        if self.handle is not None:
            self.handle.remove()
        self.checked = True


@contextlib.contextmanager
def _rank0_generators(device: torch.device, group: Group) -> Iterator[None]:
    """Draw from rank 0's generator states; afterwards rank 0 keeps the advanced states."""
    cuda = [device] if device.type == "cuda" else []
    # uint8, same sizes on every rank
    states = [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in cuda]
    packed = torch.cat(states)
    rank0 = exchange_small(
        packed, group, "broadcast", src=0, what="shard()'s broadcast of rank 0's generator states"
    ).split([s.numel() for s in states])
    with torch.random.fork_rng(devices=cuda):
        torch.set_rng_state(rank0[0].clone())
        for d, state in zip(cuda, rank0[1:]):
            torch.cuda.set_rng_state(state.clone(), d)
        yield
        after = [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in cuda]
    if group.rank == 0:
        torch.set_rng_state(after[0])
        for d, state in zip(cuda, after[1:]):
            torch.cuda.set_rng_state(state, d)


def _post_order(
    module: nn.Module, prefix: str = "", seen: set[int] | None = None
) -> Iterator[tuple[str, nn.Module]]:
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}.{name}" if prefix else name, seen)
    yield prefix, module


def _nan_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return torch.full(t.shape, float("nan"), dtype=t.dtype, device=device)
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def _swap_in_placeholders(model: nn.Module, device: torch.device) -> list[nn.Parameter]:
    """Replace every meta parameter's tensor by a zero-memory NaN one on ``device``, in place."""
    swapped = []
    for p in model.parameters():
        if not p.is_meta:
            continue
        fill = torch.full(
            (1,), float("nan") if p.is_floating_point() else 0, dtype=p.dtype, device=device
        )
        placeholder = nn.Parameter(fill.expand(p.shape), requires_grad=p.requires_grad)
        placeholder.__dict__.update(p.__dict__)
        torch.utils.swap_tensors(p, placeholder)  # check_meta_build made sure it can
        swapped.append(p)
    return swapped


@torch.no_grad()
def _initialise(name: str, module: nn.Module, init_fn: Callable[[nn.Module], None] | None) -> bool:
    """Run the module's initialiser; False if it has none."""
    reset = getattr(module, "reset_parameters", None)
    if init_fn is None and not callable(reset):
        return False
    try:
        init_fn(module) if init_fn is not None else reset()
    except Exception as exc:
        raise _init_error(name, module, init_fn, str(exc)) from exc
    return True


def _init_error(name: str, module: nn.Module, init_fn: object, why: str) -> RuntimeError:
    what = "ZeroConfig.init_fn" if init_fn is not None else "reset_parameters()"
    return RuntimeError(
        f"{what} of module {name or '<root>'!r} ({type(module).__name__}) failed during zerolite's "
        f"meta-device build: {why}. Units are materialised one at a time, so an initialiser may "
        "only write its own module's parameters and buffers. The model is left partly "
        "materialised: build it again."
    )


@torch.no_grad()
def materialize(
    model: nn.Module,
    flat_params: list[list[tuple[str, nn.Parameter]]],
    closed_by: dict[int, list[int]],
    make_flat: Callable[[int], FlatParamBuffer],
    *,
    param_dtype: torch.dtype,
    device: torch.device,
    shard: bool,
    init_fn: Callable[[nn.Module], None] | None,
    group: Group,
) -> tuple[list[FlatParamBuffer], MetaBuild]:
    """Give a meta-built model storage on ``device``; returns its flat buffers, bound.

    Every rank must call (one small collective: the generator states).

    Args:
        model: built on meta; its managed parameters are all on meta.
        flat_params: each flat buffer's ``(name, param)`` list, in buffer index order.
        closed_by: ``id(module) -> buffer indices`` complete once that module (a
            stage-3 unit) and its children are initialised; others complete at the end.
        make_flat: ``index -> FlatParamBuffer`` allocated and bound to its parameters.
        param_dtype: the buffers' dtype; parameters of another dtype are initialised in
            their own dtype first (as a normal build would) and cast when bound.
        shard: keep only this rank's shard of each buffer once complete (stage 3).
        init_fn: ``ZeroConfig.init_fn``.
    Returns:
        The flat buffers, in index order, and what is left uninitialised (a `MetaBuild`,
        kept in the model's `zerolite.state.shard_state.ShardState`; `check_before_first_forward`
        arms the check).
    """
    flat_of = {id(p): i for i, params in enumerate(flat_params) for _, p in params}
    flats: list[FlatParamBuffer | None] = [None] * len(flat_params)
    opened: set[int] = set()
    closed: set[int] = set()
    sealed: list[FlatParamBuffer] = []  # sharded already: initialisers must not write them
    uninitialised: dict[str, str] = {}
    initialised_modules: set[int] = set()

    def open_flat(i: int) -> None:
        opened.add(i)
        if all(p.dtype == param_dtype for _, p in flat_params[i]):
            flats[i] = make_flat(i)  # binding copies the NaN placeholders in
        else:
            for _, p in flat_params[i]:
                p.data = _nan_like(p, device)

    # (module name, module, flag on the device): whether a sealed unit's placeholder had
    # been written once that module's initialiser returned. Read in one host sync per unit
    # (`check_sealed`), not one per module.
    pending: list[tuple[str, nn.Module, torch.Tensor]] = []

    def check_sealed() -> None:
        if not pending:
            return
        written = torch.stack([flag for _, _, flag in pending]).tolist()
        for (name, module, _), hit in zip(pending, written):
            if hit:  # the first module after whose initialiser it was written
                raise _init_error(
                    name, module, init_fn, "it wrote a parameter of a unit already sharded"
                )
        pending.clear()

    def close_flat(i: int) -> None:
        check_sealed()
        if i not in opened:
            open_flat(i)
        closed.add(i)
        flat = flats[i] = flats[i] if flats[i] is not None else make_flat(i)
        blank = torch.stack([p.isnan().any() for _, p in flat_params[i]]).tolist()
        for (name, _), nan in zip(flat_params[i], blank):
            if nan:
                uninitialised[name] = "parameter"
        if shard:
            flat.shard_only()
            sealed.append(flat)
        phase_events.sample(
            sum(
                f.data.untyped_storage().nbytes() + (0 if f.replicated else f.shard.nbytes)
                for f in flats
                if f is not None
            )
        )

    swapped = _swap_in_placeholders(model, device)
    whole = {id(p) for p in swapped if id(p) not in flat_of}  # not sharded: full on every rank
    made_buffers: dict[int, torch.Tensor] = {}
    held: set[int] = set()  # parameters whose first holder has been initialised
    buffer_owner: dict[int, int] = {}
    with _rank0_generators(device, group):
        for name, module in _post_order(model):
            for p in module._parameters.values():
                if p is None:
                    continue
                if id(p) in flat_of and flat_of[id(p)] not in opened:
                    open_flat(flat_of[id(p)])
                elif id(p) in whole:
                    whole.discard(id(p))
                    p.data = _nan_like(p, device)
            for key, b in module._buffers.items():
                if b is not None and b.is_meta:
                    if id(b) not in made_buffers:
                        made_buffers[id(b)] = _nan_like(b, device)
                        buffer_owner[id(made_buffers[id(b)])] = id(module)
                    module._buffers[key] = made_buffers[id(b)]
            # A tied parameter keeps the values of its first holder; later holders draw
            # into a scratch copy, as their construction did before the tie was made.
            tied = {
                key: p for key, p in module._parameters.items() if p is not None and id(p) in held
            }
            for key, p in tied.items():
                module._parameters[key] = nn.Parameter(
                    _nan_like(p, device), requires_grad=p.requires_grad
                )
            if _initialise(name, module, init_fn):
                initialised_modules.add(id(module))
            if sealed:
                flags = [flat.placeholder_written() for flat in sealed]
                pending.append((name, module, torch.stack(flags).any()))
            module._parameters.update(tied)
            held.update(id(p) for p in module._parameters.values() if p is not None)
            for i in closed_by.get(id(module), []):
                close_flat(i)
        for i in range(len(flat_params)):
            if i not in closed:
                close_flat(i)
        check_sealed()
    _check_unsharded(
        model, flat_of, made_buffers, buffer_owner, initialised_modules, uninitialised
    )
    return [f for f in flats if f is not None], MetaBuild(uninitialised)


def check_before_first_forward(model: nn.Module, build: MetaBuild | None) -> None:
    """After a meta build: make the first forward raise while anything is uninitialised.

    Registered last and in front of every other forward pre-hook (stage 3 gathers in
    one), so a refused forward has changed nothing.

    Args:
        model: the sharded model.
        build: what `materialize` left uninitialised; None (no meta build) does nothing.
    """
    if build is not None:
        build.handle = model.register_forward_pre_hook(
            lambda module, args: build.check(module), prepend=True
        )


def _check_unsharded(
    model: nn.Module,
    flat_of: dict[int, int],
    made_buffers: dict[int, torch.Tensor],
    buffer_owner: dict[int, int],
    initialised_modules: set[int],
    uninitialised: dict[str, str],
) -> None:
    """Record uninitialised whole parameters and buffers; send non-persistent ones back to meta."""
    made = {id(b) for b in made_buffers.values()}
    for name, p in model.named_parameters():
        if id(p) not in flat_of and p.is_floating_point() and p.isnan().any():
            uninitialised[name] = "parameter"
    for prefix, module in model.named_modules():
        for key, b in list(module._buffers.items()):
            if b is None or id(b) not in made:
                continue
            blank = (
                b.isnan().any()
                if b.is_floating_point()
                else buffer_owner[id(b)] not in initialised_modules
            )
            if not blank:
                continue
            if key in module._non_persistent_buffers_set:
                module._buffers[key] = b.to("meta")
            else:
                uninitialised[f"{prefix}.{key}" if prefix else key] = "buffer"
