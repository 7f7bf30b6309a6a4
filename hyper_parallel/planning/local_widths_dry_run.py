"""The dry run of a block split over tp: does the model's own code run on one rank's widths?

``linear_blocks.plan_blocks`` measures which output features of a block each tp rank
needs; this dry run then runs the tiny copy once per tp rank with each split member
handing on only that rank's rows (a head-split parent computing on that rank's share of
its parameters and sizes, as the applier gives them), and checks that the consumer then
receives exactly that rank's slice of its unsplit input. A reshape or an ALiBi table built
from the global head count fails here, and the block is planned gathered instead.
"""

from collections.abc import Callable

import torch
from torch import nn

from hyper_parallel.distributed.local_views import block_sizes, local_piece, local_sizes, owner_of, packed_blocks_piece
from hyper_parallel.planning.linear_blocks import Block, HeadSplit


def _head_split_hooks(model: nn.Module, split: HeadSplit, tp: int, rank: int) -> list:
    """For the dry run: while the parent runs, its parameters and sizes are rank ``rank``'s
    share, as the applier gives them (``local_views``)."""
    module = model.get_submodule(split.name)
    saved: list[tuple[dict, dict]] = []

    def swap_in(mod, args):
        originals = {}
        for name, placement in split.states.items():
            owner, leaf = owner_of(mod, name)
            value = originals[name] = owner._parameters[leaf]
            if name in split.slices:
                dim, blocks = split.slices[name]
                local = packed_blocks_piece(value, dim, block_sizes(mod, blocks, split.name), tp, rank, split.name)
            else:
                local = local_piece(value, placement, tp, rank)
            owner._parameters[leaf] = local
        sizes = {name: getattr(mod, name) for name in split.sizes}
        for name, value in local_sizes(mod, split.sizes, tp, split.name).items():
            setattr(mod, name, value)
        saved.append((originals, sizes))

    def swap_out(mod, args, output):
        originals, sizes = saved.pop()
        for name, value in originals.items():
            owner, leaf = owner_of(mod, name)
            owner._parameters[leaf] = value
        for name, value in sizes.items():
            setattr(mod, name, value)

    return [module.register_forward_pre_hook(swap_in), module.register_forward_hook(swap_out, always_call=True)]


def local_widths_dry_run(model: nn.Module, input_ids: torch.Tensor, tp: int) -> Callable:
    """A dry run for ``analyze``: for every tp rank, each split member hands on that rank's
    rows (of each packed part), and the consumer's first input must then equal that rank's
    slice of its input in the unsplit model (it is padded back to full width to go on).
    The model's own code between them must run on the narrower tensors and compute the
    same values there (a reshape or an ALiBi table from the global head count fails one or
    the other). Returns the error text, or None."""

    def run(_model, layouts: dict[str, int], block: Block) -> str | None:
        modules = dict(model.named_modules())
        consumer = block.consumers[0]
        reference = _first_input(model, modules[consumer], input_ids)
        if reference is None or reference.shape[-1] % tp:
            return f"{consumer} received no input whose width divides by tp={tp}"
        width = reference.shape[-1] // tp
        for rank in range(tp):
            seen: dict[str, torch.Tensor] = {}
            handles = [modules[consumer].register_forward_pre_hook(_pad_input(tp, seen))]
            handles += [modules[name].register_forward_hook(_rank_rows(parts, tp, rank))
                        for name, parts in layouts.items()
                        if name not in block.consumers and not isinstance(parts, tuple)]
            if block.heads is not None:
                handles += _head_split_hooks(model, block.heads, tp, rank)
            try:
                with torch.no_grad():
                    model(input_ids=input_ids)
            except Exception as exc:  # the model's own code: any error means it does not run locally
                return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            finally:
                for handle in handles:
                    handle.remove()
            want = reference[..., rank * width:(rank + 1) * width]
            local = seen.get("input")
            if local is None or local.shape != want.shape or not torch.allclose(local, want, rtol=1e-4, atol=1e-5):
                return (f"on tp rank {rank}'s share, {consumer}'s input is not that rank's slice of the unsplit "
                        "model's (the code between computes something else on a share)")
        return None

    return run


def _first_input(model: nn.Module, module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor | None:
    seen: dict[str, torch.Tensor] = {}
    handle = module.register_forward_pre_hook(_pad_input(1, seen))
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        handle.remove()
    return seen.get("input")


def _rank_rows(parts: int, tp: int, rank: int):
    def hook(module, args, output):
        if not isinstance(output, torch.Tensor):
            return output
        size = output.shape[-1] // parts
        piece = size // tp
        return torch.cat([output[..., p * size + rank * piece:p * size + (rank + 1) * piece] for p in range(parts)],
                         dim=-1)
    return hook


def _pad_input(tp: int, seen: dict[str, torch.Tensor]):
    """Records the module's first input, and hands it on ``tp`` times as wide."""
    def hook(module, args):
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        local = args[0]
        seen.setdefault("input", local.detach().clone())
        return None if tp == 1 else (torch.cat([local] * tp, dim=-1), *args[1:])
    return hook
