"""All experts of an MoE layer in one batched computation.

``GroupedExperts`` is a drop-in replacement for transformers' packed experts (the
layout of ``Qwen3MoeExperts`` and the other families whose experts are one module with
``gate_up_proj`` [E, 2I, H] packing gate and up along dim 1, ``down_proj`` [E, H, I] and
an ``act_fn``): the same parameters, the same forward ``(hidden_states, top_k_index,
top_k_weights)`` and the same result. A model's adapter names it as its
``replace_module`` target (``models/qwen3_moe/adapter/replacements.py``). HF's eager forward loops over the experts in
Python, gathers each expert's tokens with ``torch.where`` and slices the stacked
weights per expert (whose backward allocates a full-size gradient per expert).
Here the (token, expert) pairs are sorted by expert once and the experts run as
grouped matmuls with a hand-written backward (``routed_experts``): on CPU one ``mm``
per expert over its contiguous rows, elsewhere one padded ``bmm`` per projection
unless routing is so uneven that padding would more than double the work. On CUDA in
bfloat16 (the dtype its kernel is made for) the default is torch's grouped matmul kernel
(``torch._grouped_mm``, layout ``grouped_mm``): one kernel per projection over every
expert's rows, no padding, torch's autograd for the backward; what transformers' own
``grouped_mm`` experts run on Hopper GPUs. ``layout`` forces one of the three.

Sizes come from the parameter tensors at every call, never from a config: under the
applier's ``local_map`` the module runs on tensor-parallel local shards
(``gate_up_proj`` [E, 2I/tp, H] with the gate and up halves of the local slice packed
the same way, ``down_proj`` [E, H, I/tp]) and the same code computes the local part.
Expert ids outside ``[0, E)`` (an expert-parallel sentinel) select nothing.

The replacement factory returns an instance of a subclass of both ``GroupedExperts``
and the replaced class (say HF's ``Qwen3MoeExperts`` or a generated file's copy), so
the model's own ``_init_weights`` initializes it exactly as it did the original.
"""

import torch
from torch import nn
from transformers.activations import ACT2FN

from hyper_parallel.components.modules.routed_experts import (
    ExpertRoutes,
    ExpertRows,
    grouped_mm_experts,
    routed_experts,
)

# Off CPU, pad every expert to the busiest one's row count while that costs at most
# this many times the routed rows; beyond it the packed layout wastes less.
DEFAULT_MAX_PADDING_RATIO = 2.0
LAYOUTS = ("auto", "packed", "padded", "grouped_mm")


class GroupedExperts(nn.Module):
    """``num_experts`` gated MLPs ``down(act(x @ gate.T) * (x @ up.T))``, weighted and
    summed per token over the experts it was routed to."""

    # Like torch's own layers, initialize when built off the meta device.
    initialize_on_construction = True

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, *,
                 activation: str = "silu", initializer_range: float = 0.02,
                 max_padding_ratio: float = DEFAULT_MAX_PADDING_RATIO, layout: str = "auto",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        # nn.Module.__init__ rather than super().__init__(): a grouped_experts_class_for()
        # class must not run the replaced class's __init__ (it allocates its own parameters).
        nn.Module.__init__(self)
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.activation = activation
        self.act_fn = ACT2FN[activation]
        self.initializer_range = initializer_range
        self.max_padding_ratio = max_padding_ratio
        if layout not in LAYOUTS:
            raise ValueError(f"GroupedExperts: layout {layout!r} is not one of {LAYOUTS}")
        self.layout = layout
        # The attributes HF's @use_experts_implementation gives its experts, so code that
        # inspects an experts module (the planner's packed_experts role) reads the layout.
        self.is_transposed = False
        self.has_gate = True
        self.has_bias = False
        factory = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, hidden_dim, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, intermediate_dim, **factory))
        if self.initialize_on_construction and self.gate_up_proj.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """HF's ``_init_weights`` for experts: normal(0, initializer_range), gate_up then
        down. Call it again after materializing a meta-device model (``to_empty``)."""
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=self.initializer_range)
        nn.init.normal_(self.down_proj, mean=0.0, std=self.initializer_range)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, activation={self.activation}, layout={self.layout}")

    # Eager under torch.compile: the row counts are data (one host sync per call), so
    # a traced graph would be specialized to, and recompiled for, every routing.
    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """``hidden_states`` [T, H], ``top_k_index`` / ``top_k_weights`` [T, K] → [T, H]."""
        # No early return when nothing is routed here: the result stays on the autograd
        # graph, so the weights get zero gradients rather than none (a rank whose
        # gradient is missing would skip the data-parallel reduction its peers wait in).
        routes = ExpertRoutes.of(top_k_index, self.gate_up_proj.shape[0])
        if self._groups_in_one_kernel(hidden_states.device):
            return grouped_mm_experts(hidden_states, top_k_weights, self.gate_up_proj, self.down_proj, routes,
                                      self.act_fn)
        if self._pads(routes, hidden_states.device):
            rows = ExpertRows.padded_to_capacity(routes, hidden_states.shape[0], top_k_index.numel())
        else:
            rows = ExpertRows.packed(routes)
        return routed_experts(hidden_states, top_k_weights, self.gate_up_proj, self.down_proj, rows, self.act_fn)

    def _groups_in_one_kernel(self, device: torch.device) -> bool:
        """``torch._grouped_mm``: when asked, or by default on CUDA in bfloat16."""
        if self.layout != "auto":
            return self.layout == "grouped_mm"
        return device.type == "cuda" and self.gate_up_proj.dtype == torch.bfloat16

    def _pads(self, routes: ExpertRoutes, device: torch.device) -> bool:
        if self.layout != "auto":
            return self.layout == "padded"
        # On CPU a loop of mm's runs at the matmul rate already; padding only adds work.
        return device.type != "cpu" and routes.padded_size <= self.max_padding_ratio * routes.count


def grouped_experts_class_for(experts_class: type[nn.Module]) -> type[GroupedExperts]:
    """``GroupedExperts`` that is also an ``experts_class`` (HF's ``Qwen3MoeExperts`` or a
    generated file's copy of it): the model's ``_init_weights``, which dispatches on
    ``isinstance(module, Qwen3MoeExperts)``, then initializes the replacement exactly as
    it would the original (normal(0, initializer_range), in the model's module order, so
    a seed gives the same weights), and other ``isinstance`` checks keep holding. The
    forward is ``GroupedExperts.forward`` (first in the MRO). One class per original."""
    if issubclass(experts_class, GroupedExperts):
        return experts_class
    if experts_class not in _GROUPED_CLASSES:
        _GROUPED_CLASSES[experts_class] = type(f"Grouped{experts_class.__name__}", (GroupedExperts, experts_class), {
            "__module__": __name__,
            "__doc__": f"GroupedExperts standing in for {experts_class.__module__}.{experts_class.__qualname__}.",
            # As the original: allocated empty, initialized by the model's post_init
            # (drawing random numbers when built would shift every later module's init).
            "initialize_on_construction": False,
        })
    return _GROUPED_CLASSES[experts_class]


_GROUPED_CLASSES: dict[type, type] = {}


def replace_with_grouped_experts(module: nn.Module, **kwargs) -> GroupedExperts:
    """``replace_module`` factory: a ``GroupedExperts`` that is also a ``type(module)``
    (see :func:`grouped_experts_class_for`), on ``module``'s device and dtype, with its
    weights unless they are on the meta device. ``module`` is a packed-experts module
    (HF's class or a generated copy); sizes come from its tensors, so local shards work too.
    ``kwargs``: ``max_padding_ratio``, ``layout`` (``auto``, ``packed``, ``padded``, ``grouped_mm``)."""
    unknown = sorted(set(kwargs) - {"max_padding_ratio", "layout"})
    if unknown:
        raise TypeError(f"replace_with_grouped_experts: unknown static argument(s) {unknown}; "
                        f"expected only 'max_padding_ratio' and 'layout'")
    params = dict(module.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"} or not hasattr(module, "act_fn"):
        raise TypeError(f"replace_with_grouped_experts: {type(module).__name__} has parameters "
                        f"{sorted(params)} (act_fn: {hasattr(module, 'act_fn')}); expected packed experts "
                        f"(as Qwen3MoeExperts) with gate_up_proj, down_proj and act_fn")
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    _check_shapes(gate_up, down)
    config = getattr(module, "config", None)
    new = grouped_experts_class_for(type(module))(
        gate_up.shape[0], gate_up.shape[2], down.shape[2],
        activation=getattr(config, "hidden_act", "silu"),
        initializer_range=getattr(config, "initializer_range", 0.02),
        device=gate_up.device, dtype=gate_up.dtype, **kwargs)
    new.act_fn = module.act_fn
    if config is not None:
        new.config = config  # HF's experts keep it (the experts_implementation dispatch reads it)
    new._is_expert_parallel = getattr(module, "_is_expert_parallel", False)
    new.train(module.training)
    if gate_up.device.type != "meta":
        with torch.no_grad():
            new.gate_up_proj.copy_(gate_up)
            new.down_proj.copy_(down)
        # Same init state as the weights it took: an HF init_weights() after loading
        # must not overwrite them; before post_init the flag is unset and HF inits it.
        if getattr(module, "_is_hf_initialized", False):
            new._is_hf_initialized = True
    new.gate_up_proj.requires_grad_(gate_up.requires_grad)
    new.down_proj.requires_grad_(down.requires_grad)
    return new


def _check_shapes(gate_up: torch.Tensor, down: torch.Tensor) -> None:
    experts, packed, hidden = gate_up.shape
    if down.dim() != 3 or packed % 2 or down.shape != (experts, hidden, packed // 2):
        raise ValueError(f"replace_with_grouped_experts: gate_up_proj {tuple(gate_up.shape)} and "
                         f"down_proj {tuple(down.shape)} do not fit; expected [E, 2I, H] and [E, H, I]")
