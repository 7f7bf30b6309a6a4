"""``training.compile``: ``torch.compile`` of the decoder layers, one by one.

As torchtitan does it: each repeated block is compiled in place (``nn.Module.compile``,
so parameter names do not change), after the plan and activation checkpointing and
before FSDP2 wraps the layers. Layers of one class share their compiled code; the
embedding, the head and loss, and the plan's conversions between blocks stay eager
(they hold the collectives the plan places at module boundaries). A whole-model compile
fails on DTensor outputs that alias one another (torch refuses any output aliasing when
a graph has tensor-subclass outputs)."""

from torch import nn

from hyper_parallel.distributed.fsdp import decoder_layers


def compile_decoder_layers(model: nn.Module) -> int:
    """Compile each decoder layer of ``model`` in place; the number compiled. A model
    without ``_no_split_modules`` layers is compiled whole."""
    layers = decoder_layers(model)
    if not layers:
        model.compile()
        return 0
    for layer in layers:
        layer.compile()
    return len(layers)


def compiled_modules(model: nn.Module) -> list[str]:
    """The modules of ``model`` whose calls run compiled (``nn.Module.compile`` set their
    compiled call), by name: what the trainer reports, read from the modules themselves."""
    return [name or "<model>" for name, module in model.named_modules()
            if getattr(module, "_compiled_call_impl", None) is not None]
