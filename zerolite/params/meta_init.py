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

from zerolite.comm.collectives import Group
from zerolite.comm.small_collectives import small_collective
from zerolite.ground import phase_events, runtime
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
    own = [device] if runtime.is_accelerator(device) else []  # the device's own generator
    # uint8, same sizes on every rank
    states = [torch.get_rng_state()] + [runtime.rng_state(d) for d in own]
    packed = torch.cat(states)
    rank0 = small_collective(
        packed, group, "broadcast", src=0, what="shard()'s broadcast of rank 0's generator states"
    ).split([s.numel() for s in states])
    with runtime.fork_rng(own):
        torch.set_rng_state(rank0[0].clone())
        for d, state in zip(own, rank0[1:]):
            runtime.set_rng_state(d, state.clone())
        yield
        after = [torch.get_rng_state()] + [runtime.rng_state(d) for d in own]
    if group.rank == 0:
        torch.set_rng_state(after[0])
        for d, state in zip(own, after[1:]):
            runtime.set_rng_state(d, state)


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
    build = _Materializer(
        flat_params, make_flat, param_dtype=param_dtype, device=device, shard=shard,
        init_fn=init_fn,
    )
    swapped = _swap_in_placeholders(model, device)
    build.whole = {id(p) for p in swapped if id(p) not in build.flat_of}
    with _rank0_generators(device, group):
        for name, module in _post_order(model):
            build.give_storage(module)
            build.initialise(name, module)
            for i in closed_by.get(id(module), []):
                build.close_flat(i)
        for i in range(len(flat_params)):
            if i not in build.closed:
                build.close_flat(i)
        build.check_sealed()
    _check_unsharded(
        model, build.flat_of, build.made_buffers, build.buffer_owner,
        build.initialised_modules, build.uninitialised,
    )
    return [f for f in build.flats if f is not None], MetaBuild(build.uninitialised)


class _Materializer:
    """One meta build while `materialize` visits the modules, children first: which flat
    buffers are open (allocated, parameters bound) and closed (complete; sharded in stage 3,
    then *sealed*: no initialiser may write them), and what nothing initialised."""

    def __init__(
        self,
        flat_params: list[list[tuple[str, nn.Parameter]]],
        make_flat: Callable[[int], FlatParamBuffer],
        *,
        param_dtype: torch.dtype,
        device: torch.device,
        shard: bool,
        init_fn: Callable[[nn.Module], None] | None,
    ) -> None:
        self.flat_params = flat_params
        self.make_flat = make_flat
        self.param_dtype = param_dtype
        self.device = device
        self.shard = shard
        self.init_fn = init_fn
        self.flat_of = {id(p): i for i, params in enumerate(flat_params) for _, p in params}
        self.flats: list[FlatParamBuffer | None] = [None] * len(flat_params)
        self.opened: set[int] = set()
        self.closed: set[int] = set()
        self.sealed: list[FlatParamBuffer] = []  # sharded already: initialisers must not write
        self.uninitialised: dict[str, str] = {}
        self.initialised_modules: set[int] = set()
        self.whole: set[int] = set()  # parameters not sharded: full on every rank
        self.made_buffers: dict[int, torch.Tensor] = {}
        self.buffer_owner: dict[int, int] = {}
        self.held: set[int] = set()  # parameters whose first holder has been initialised
        # (module name, module, flag on the device): whether a sealed unit's placeholder had
        # been written once that module's initialiser returned. Read in one host sync per
        # unit (`check_sealed`), not one per module.
        self.pending: list[tuple[str, nn.Module, torch.Tensor]] = []

    def open_flat(self, i: int) -> None:
        self.opened.add(i)
        if all(p.dtype == self.param_dtype for _, p in self.flat_params[i]):
            self.flats[i] = self.make_flat(i)  # binding copies the NaN placeholders in
        else:
            for _, p in self.flat_params[i]:
                p.data = _nan_like(p, self.device)

    def check_sealed(self) -> None:
        if not self.pending:
            return
        written = torch.stack([flag for _, _, flag in self.pending]).tolist()
        for (name, module, _), hit in zip(self.pending, written):
            if hit:  # the first module after whose initialiser it was written
                raise _init_error(
                    name, module, self.init_fn, "it wrote a parameter of a unit already sharded"
                )
        self.pending.clear()

    def close_flat(self, i: int) -> None:
        self.check_sealed()
        if i not in self.opened:
            self.open_flat(i)
        self.closed.add(i)
        flat = self.flats[i] = self.flats[i] if self.flats[i] is not None else self.make_flat(i)
        blank = torch.stack([p.isnan().any() for _, p in self.flat_params[i]]).tolist()
        for (name, _), nan in zip(self.flat_params[i], blank):
            if nan:
                self.uninitialised[name] = "parameter"
        if self.shard:
            flat.shard_only()
            self.sealed.append(flat)
        phase_events.sample(
            sum(
                f.data.untyped_storage().nbytes() + (0 if f.replicated else f.shard.nbytes)
                for f in self.flats
                if f is not None
            )
        )

    def give_storage(self, module: nn.Module) -> None:
        """Storage (NaN) for ``module``'s own parameters and meta buffers, before its
        initialiser runs: a parameter's flat buffer opens at its first holder."""
        for p in module._parameters.values():
            if p is None:
                continue
            if id(p) in self.flat_of and self.flat_of[id(p)] not in self.opened:
                self.open_flat(self.flat_of[id(p)])
            elif id(p) in self.whole:
                self.whole.discard(id(p))
                p.data = _nan_like(p, self.device)
        for key, b in module._buffers.items():
            if b is not None and b.is_meta:
                if id(b) not in self.made_buffers:
                    self.made_buffers[id(b)] = _nan_like(b, self.device)
                    self.buffer_owner[id(self.made_buffers[id(b)])] = id(module)
                module._buffers[key] = self.made_buffers[id(b)]

    def initialise(self, name: str, module: nn.Module) -> None:
        """Run ``module``'s initialiser. A tied parameter keeps the values of its first
        holder; later holders draw into a scratch copy, as their construction did before the
        tie was made."""
        tied = {
            key: p for key, p in module._parameters.items() if p is not None and id(p) in self.held
        }
        for key, p in tied.items():
            module._parameters[key] = nn.Parameter(
                _nan_like(p, self.device), requires_grad=p.requires_grad
            )
        if _initialise(name, module, self.init_fn):
            self.initialised_modules.add(id(module))
        if self.sealed:
            flags = [flat.placeholder_written() for flat in self.sealed]
            self.pending.append((name, module, torch.stack(flags).any()))
        module._parameters.update(tied)
        self.held.update(id(p) for p in module._parameters.values() if p is not None)


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
