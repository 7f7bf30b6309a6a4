"""Pipeline parallel on ``torch.distributed.pipelining``: the stages of a causal LM a pp rank runs
(one, or ``virtual_stages`` of them for an interleaved schedule).

A rank's model is the whole model object with what other ranks' stages run taken out
(``prune_to_stage``): decoder layers outside its stages' ranges become ``PassThrough``s,
which hand their input on, so the remaining layers keep their indices (HF models look
up per-layer settings, such as sliding or full attention, by the index in the layer
loop); stages after the first drop the input embeddings, stages before the last drop
the final norm (a pass-through there) and the head. Module names do not change, so the
frozen plan applies to a stage as it does to the whole model (plan keys that only name
pruned modules are skipped, ``pruned_names``), and checkpoints keep the model's keys.

``StageModule`` runs a stage: the first from token ids, the others from the hidden
states the stage before sent; the last returns logits, which the schedule hands to the
loss. The model's own forward does the work (rotary embeddings, the causal mask), so
every family whose forward accepts ``inputs_embeds`` runs unchanged.

``build_schedule`` wraps each of the rank's stages in torch's ``PipelineStage`` and hands
them to one of its schedules. The loss of each micro-batch is the model's loss (``loss_function``, the
sharded one under loss parallel) divided by the number of micro-batches, and the
schedule does not rescale gradients, so a step's gradients are those of the mean of
the micro-batch losses, as gradient accumulation without pipelining gives.
"""

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyper_parallel.distributed.model_parts import decoder_layers, input_embeddings, output_embeddings
from hyper_parallel.distributed.name_match import name_matches
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.platform.device import REDUCE_DTYPE
from hyper_parallel.protocols.sharding import ShardingConfig

# Set on a pruned model: its StageInfo.
STAGE_ATTRIBUTE = "hyper_pipeline_stage"
# The base model's final norm, by the names transformers' families give it.
FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")


class PipelineSplitError(ValueError, HyperParallelError):
    """A model that cannot be split into pipeline stages as asked; names what is missing."""


class PrunedModule(nn.Module):
    """Stands where a module another stage runs was: no parameters, and no forward."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineSplitError(f"{self.what} runs on another pipeline stage")


class PassThrough(PrunedModule):
    """A decoder layer (or the final norm) another stage runs: the hidden states pass
    through unchanged. It keeps the plain settings of the module it stands for (such as a
    layer's ``attention_type``), which the base model's forward reads to pick each layer's
    mask."""

    def __init__(self, what: str, like: nn.Module | None = None):
        super().__init__(what)
        for key, value in vars(like or nn.Module()).items():
            if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool, type(None))):
                setattr(self, key, value)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


@dataclass(frozen=True)
class StageInfo:
    """The pipeline stages one rank runs (one, or ``virtual_stages`` for an interleaved
    schedule) and what the rank's model took out."""

    stages: tuple[int, ...]  # the stage indices, in order
    num_stages: int
    boundaries: tuple[tuple[int, int], ...]  # [start, end) decoder layers of every stage of the run
    pruned: tuple[str, ...]  # the module names (and their submodules') taken out

    @property
    def is_first(self) -> bool:
        """The rank runs the first stage (it embeds the tokens)."""
        return 0 in self.stages

    @property
    def is_last(self) -> bool:
        """The rank runs the last stage (its logits meet the loss)."""
        return self.num_stages - 1 in self.stages

    @property
    def layers(self) -> tuple[int, ...]:
        """The decoder layers the rank runs, over all its stages."""
        return tuple(i for stage in self.stages for i in range(*self.boundaries[stage]))


def decoder_layer_weights(model: nn.Module) -> list[int]:
    """Each decoder layer's parameter count (meta tensors count too): what a balanced
    split evens out across stages."""
    found = decoder_layers(model)
    if found is None:
        raise PipelineSplitError(f"{type(model).__name__}: no decoder layer list to split into pipeline stages")
    return [sum(p.numel() for p in layer.parameters()) for layer in found[1]]


def prune_to_stage(model: nn.Module, boundaries: tuple[tuple[int, int], ...], stages: tuple[int, ...]) -> StageInfo:
    """Take out of ``model`` (in place) what the stages other than ``stages`` (this rank's)
    run; record and return them (``STAGE_ATTRIBUTE``)."""
    found = decoder_layers(model)
    if found is None:
        raise PipelineSplitError(f"{type(model).__name__}: no decoder layer list to split into pipeline stages")
    list_name, layers = found
    held = {i for stage in stages for i in range(*boundaries[stage])}
    info_first, info_last = 0 in stages, len(boundaries) - 1 in stages
    names = dict((id(module), name) for name, module in model.named_modules())
    pruned: list[str] = []

    def take_out(name: str, replacement: nn.Module) -> None:
        pruned.extend(n for n, _ in model.get_submodule(name).named_modules(prefix=name))
        model.set_submodule(name, replacement)

    def name_of(part: nn.Module | None, what: str, getter: str, stage: str) -> str:
        if part is None or id(part) not in names:
            raise PipelineSplitError(f"{type(model).__name__}: no {what} ({getter}) to leave to the {stage} "
                                     f"pipeline stage")
        return names[id(part)]

    for position in range(len(layers)):
        if position not in held:
            take_out(f"{list_name}.{position}", PassThrough(f"decoder layer {position}", like=layers[position]))
    # Tied embeddings stay on both end stages: one matrix, so keeping its other module
    # costs nothing, the names stay the whole model's (loading, checkpoints), and the
    # trainer sums the two stages' gradients (TiedEmbeddingGradients).
    tied = tied_embeddings(model)
    if not info_first and not (tied and info_last):
        take_out(name_of(input_embeddings(model), "input embeddings", "get_input_embeddings", "first"),
                 PrunedModule("the input embeddings"))
    if not info_last:
        if not (tied and info_first):
            take_out(name_of(output_embeddings(model), "output head", "get_output_embeddings", "last"),
                     PrunedModule("the output head"))
        norm = _final_norm_name(model)
        take_out(norm, PassThrough("the final norm", like=model.get_submodule(norm)))
    info = StageInfo(tuple(stages), len(boundaries), tuple(boundaries), tuple(pruned))
    model.__dict__[STAGE_ATTRIBUTE] = info
    return info


def _final_norm_name(model: nn.Module) -> str:
    base = getattr(model, "base_model", model)
    prefix = next((name for name, module in model.named_modules() if module is base), "")
    for name in FINAL_NORM_NAMES:
        if isinstance(getattr(base, name, None), nn.Module):
            return f"{prefix}.{name}" if prefix else name
    raise PipelineSplitError(f"{type(base).__name__}: no final norm among {', '.join(FINAL_NORM_NAMES)} to leave to "
                             f"the last pipeline stage; this family cannot be split into pipeline stages yet")


HANDOFF_TOKENS = 8  # the sequence length of check_stage_handoff's forward


def check_stage_handoff(model: nn.Module) -> None:
    """Refuse (``PipelineSplitError``, naming the family and what it does) a model whose
    stages, run in turn, would not compute what the whole model does.

    A stage after the first gives the hidden states it received to its base model as
    ``inputs_embeds``, and a stage before the last hands on its last layer's output. That is
    the whole model's computation only where the base model's forward passes
    ``inputs_embeds`` to decoder layer 0 untouched (no position embeddings, scaling,
    dropout or norm of the embeddings there: GPT-2 adds ``wpe``), each layer's output to
    the next layer, the last layer's to the final norm, and the final norm's out as
    ``last_hidden_state``; each layer once, in order. The check runs that forward with every
    layer and the final norm handing on (no layer math, so it runs on the meta device too)
    and follows the one tensor it gave in."""
    found = decoder_layers(model)
    if found is None:
        raise PipelineSplitError(f"{type(model).__name__}: no decoder layer list to split into pipeline stages")
    layers = list(found[1])
    norm = model.get_submodule(_final_norm_name(model))
    base = getattr(model, "base_model", model)
    embedding = input_embeddings(model)
    weight = getattr(embedding, "weight", None)
    if weight is None or weight.dim() != 2:
        raise PipelineSplitError(f"{type(model).__name__}: no input embedding matrix to size the hidden states a "
                                 f"pipeline stage hands on")
    # On the meta device position ids built from the input would meet data-dependent
    # checks (the packed-sequence test calls .item()); the buffers they meet are real.
    device = weight.device if weight.device.type != "meta" else torch.device("cpu")
    # Values no embedding row holds: a family that reads token ids back from its input
    # (Gemma 4's per-layer embeddings) fails here as it would on a later stage.
    width = weight.shape[1]
    given = torch.linspace(-1, 1, HANDOFF_TOKENS * width, dtype=weight.dtype, device=device).reshape(1, -1, width)
    events: list[tuple[str, Any]] = []  # (what ran, the hidden states it received)

    running: list[str] = []  # the base model's other children entered and not yet left

    def note(out: Any, name: str) -> None:
        running.remove(name)
        if isinstance(out, torch.Tensor) and out.shape[-1:] == given.shape[-1:]:  # a hidden-state-wide result
            events.append((name, None))

    hooks, stand_ins = [], {}
    for name, child in base.named_children():
        if child is not found[1] and child is not norm and child is not embedding:
            hooks.append(child.register_forward_pre_hook(lambda module, args, name=name: running.append(name)))
            hooks.append(child.register_forward_hook(lambda module, args, out, name=name: note(out, name)))
            # meta tensors of what runs between the layers (GPT-2's wpe): CPU stand-ins for
            # this one call (their values do not matter, only what the forward does with them)
            stand_ins.update({f"{name}.{key}": torch.empty(tensor.shape, dtype=tensor.dtype)
                              for key, tensor in itertools.chain(child.named_parameters(), child.named_buffers())
                              if tensor.device.type == "meta"})

    def recorder(what: str) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            hidden = args[0] if args else kwargs.get("hidden_states")
            events.append((what, hidden))
            return hidden
        return forward

    parts = [(f"decoder layer {i}", layer) for i, layer in enumerate(layers)] + [("the final norm", norm)]
    for what, module in parts:
        module.forward = recorder(what)  # an instance attribute: module.__call__ finds it first
    modes = {module: module.training for module in model.modules()}
    model.train()  # as the stages run: embedding dropout is a change too
    try:
        with torch.no_grad():
            output = torch.func.functional_call(base, stand_ins, (), {"inputs_embeds": given, "use_cache": False},
                                                strict=False)
    except Exception as exc:
        where = f" in {running[-1]}" if running else ""
        raise PipelineSplitError(_handoff_refusal(model, f"its forward fails{where} with the decoder layers handing "
                                                         f"the hidden states on ({type(exc).__name__}: "
                                                         f"{' '.join(str(exc).split())[:200]})")) from None
    finally:
        for _, module in parts:
            del module.forward
        for hook in hooks:
            hook.remove()
        for module, training in modes.items():
            module.training = training
    _check_handoff_events(model, events, given, output, [what for what, _ in parts])


def _check_handoff_events(model: nn.Module, events: list[tuple[str, Any]], given: torch.Tensor, output: Any,
                          expected: list[str]) -> None:
    """``check_stage_handoff``'s verdict on what the base model's forward did with ``given``."""
    ran = [what for what, hidden in events if what in expected]
    if ran != expected:
        raise PipelineSplitError(_handoff_refusal(model, f"its forward runs {', '.join(ran) or 'no decoder layer'} "
                                                         f"where a split needs each decoder layer once, in order, "
                                                         f"then the final norm"))
    between: list[str] = []
    before = "the input embeddings"
    for what, hidden in events:
        if what not in expected:
            between.append(what)
            continue
        if hidden is not given:
            ran_between = f" (it runs {', '.join(between)} there)" if between else ""
            raise PipelineSplitError(_handoff_refusal(
                model, f"its forward changes the hidden states between {before} and {what}{ran_between}, so "
                       f"the stages would not compute what the whole model does"))
        between, before = [], what
    last = getattr(output, "last_hidden_state", None)
    if last is None and isinstance(output, tuple) and output:
        last = output[0]
    same = last is given or (isinstance(last, torch.Tensor) and last._base is given and last.shape == given.shape)
    if not same:
        raise PipelineSplitError(_handoff_refusal(model, "its forward changes the final norm's output before "
                                                         "returning it as last_hidden_state"))


def _handoff_refusal(model: nn.Module, what: str) -> str:
    base = getattr(model, "base_model", model)
    return (f"{type(base).__name__} cannot be split into pipeline stages: {what}; set accelerator.pp_size: 1 "
            f"for this family (model_type {getattr(getattr(model, 'config', None), 'model_type', '?')})")


def pruned_names(model: nn.Module) -> tuple[str, ...]:
    """The module names a pipeline stage took out (none for a whole model)."""
    info = model.__dict__.get(STAGE_ATTRIBUTE)
    return info.pruned if info is not None else ()


def names_only_pruned(key: str, pruned: tuple[str, ...]) -> bool:
    """A plan key that hits no module of a stage but would hit one it took out."""
    return any(name_matches(name, key) for name in pruned)


def whole_sequence_between_stages(model: nn.Module, targets: dict[str, ShardingConfig]) -> dict[str, ShardingConfig]:
    """A pipeline stage's plan (``targets``: module name -> its entry, the applier's) where
    the plan splits the residual stream over the sequence (sequence or context parallel:
    the first decoder layer's entry takes its input whole and keeps the rank's piece):
    a later stage's first layer splits its input the same way, and a stage before the
    last gathers its last layer's output back to the whole sequence before handing it on.
    So every stage's base model gets the whole sequence, and the positions and causal
    mask it makes from it are the whole model's; the price is one gather per stage
    boundary. Other models and plans come back as they are."""
    info = model.__dict__.get(STAGE_ATTRIBUTE)
    found = decoder_layers(model)
    if info is None or found is None:
        return targets
    list_name = found[0]
    split = targets.get(f"{list_name}.0")
    if split is None or not split.in_src or not split.in_dst or split.in_src[0] == split.in_dst[0]:
        return targets
    whole, piece = split.in_src[0], split.in_dst[0]
    out = dict(targets)
    for stage in info.stages:
        start, end = info.boundaries[stage]
        if stage > 0:
            name = f"{list_name}.{start}"
            config = out.get(name) or ShardingConfig()
            out[name] = dataclasses.replace(config, in_src=(whole, *(config.in_src or ())[1:]),
                                            in_dst=(piece, *(config.in_dst or ())[1:]), local_map=True)
        if stage < info.num_stages - 1:
            name = f"{list_name}.{end - 1}"
            config = out.get(name) or ShardingConfig(local_map=True)
            out[name] = dataclasses.replace(config, out_src=(piece,), out_dst=(whole,), local_map=True)
    return out


class StageModule(nn.Module):
    """Pipeline stage ``stage`` of a causal LM: token ids or hidden states in, hidden
    states or (last stage) logits out. Holds the rank's pruned model as ``model``; where
    the rank runs other stages too (interleaved and V schedules), their layers, and the
    final norm for a stage before the last, are swapped for pass-throughs during this
    stage's forward: the modules themselves are not called, so none of their hooks (the
    plan's input and output conversions, FSDP2's gathers) runs for a stage that is not
    theirs."""

    def __init__(self, model: nn.Module, stage: int):
        super().__init__()
        self.model = model
        info: StageInfo = model.__dict__[STAGE_ATTRIBUTE]
        self.first, self.last = stage == 0, stage == info.num_stages - 1
        start, end = info.boundaries[stage]
        list_name, layers = decoder_layers(model)
        # (name, stand-in): a plain list, so the stand-ins are not this module's submodules
        self.stand_ins = [(f"{list_name}.{i}", PassThrough(f"decoder layer {i} (another stage's)", like=layers[i]))
                          for i in info.layers if not start <= i < end]
        if not self.last and info.is_last:  # the rank holds the real final norm for the last stage
            norm = _final_norm_name(model)
            self.stand_ins.append((norm, PassThrough("the final norm", like=model.get_submodule(norm))))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        given = {"input_ids": inputs} if self.first else {"inputs_embeds": inputs}
        held = [(name, self.model.get_submodule(name)) for name, _ in self.stand_ins]
        for name, stand_in in self.stand_ins:
            self.model.set_submodule(name, stand_in)
        try:
            if self.last:
                return self.model(**given, use_cache=False).logits
            return self.model.base_model(**given, use_cache=False).last_hidden_state
        finally:
            for name, module in held:
                self.model.set_submodule(name, module)


SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                    "dualpipev": "ScheduleDualPipeV"}


def build_schedule(model: nn.Module, *, schedule: str, microbatches: int, pp_group: Any,
                   device: torch.device) -> Any:
    """torch's schedule ``schedule`` over this rank's stages of the pruned ``model``. A
    micro-batch's loss is the model's own (``loss_function``: the sharded one under loss
    parallel) divided here by the number of micro-batches, with the schedule's own
    gradient scaling off."""
    from torch.distributed import pipelining

    info: StageInfo = model.__dict__[STAGE_ATTRIBUTE]

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size)

    stages = [pipelining.PipelineStage(StageModule(model, stage), stage, info.num_stages, device, group=pp_group)
              for stage in info.stages]

    def micro_batch_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss(logits, labels) / microbatches

    schedule_class = getattr(pipelining, SCHEDULE_CLASSES[schedule])
    return schedule_class(stages if len(stages) > 1 else stages[0], n_microbatches=microbatches,
                          loss_fn=micro_batch_loss, scale_grads=False)


def through_pipeline(model: nn.Module, run: Callable[..., Any], rows: torch.Tensor, pp_group: Any,
                     **options: Any) -> torch.Tensor:
    """``run`` (a schedule's ``step`` or ``eval``) over this dp rank's ``rows``: the first
    stage feeds them, the last compares its logits with them (the loss shifts the labels);
    returns the sum of the micro-batch losses (each already divided by their number: the
    step's mean loss) on every stage of ``pp_group``, from the rank that runs the last. The trainer
    and verify run a pipeline step through this one function."""
    import torch.distributed as dist

    info: StageInfo = model.__dict__[STAGE_ATTRIBUTE]
    losses: list[torch.Tensor] = []
    run(*((rows,) if info.is_first else ()), target=rows if info.is_last else None,
        losses=losses if info.is_last else None, **options)
    total = torch.zeros((), dtype=REDUCE_DTYPE, device=rows.device)  # the run's device: nccl/hccl take no CPU tensor
    if info.is_last:
        total = sum((loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach())
                    for loss in losses).to(REDUCE_DTYPE)
    dist.all_reduce(total, group=pp_group)  # from the one rank that runs the last stage, wherever it sits
    return total


def tied_embeddings(model: nn.Module) -> bool:
    """The model's head reuses its input embedding matrix (``tie_word_embeddings``)."""
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


class TiedEmbeddingGradients:
    """Input and output embeddings that are one matrix (``tie_word_embeddings``) sit on
    the first and the last pipeline stage (``prune_to_stage`` keeps both modules there),
    each stage with its own copy: the first uses it to embed, the last as its head. Their gradients
    are summed across the two (``sum``: one all-reduce between the first- and last-stage
    ranks of each dp/cp/tp coordinate), so both copies take the same update the one
    matrix takes in the whole model, and the gradient norm counts the matrix once
    (``counted``: every parameter but the last stage's copy)."""

    def __init__(self, model: nn.Module, device_mesh: Any, settings: Any):
        import torch.distributed as dist

        self.model, self.info = model, model.__dict__[STAGE_ATTRIBUTE]
        self.group, self.copy = None, None
        pp = device_mesh.mesh.shape[0]
        first, last = settings.rank_of_stage(0, pp), settings.rank_of_stage(self.info.num_stages - 1, pp)
        if first == last:  # a V schedule: both ends on one rank, the one matrix there
            return
        ranks = device_mesh.mesh.reshape(pp, -1)  # pp outermost, the rest flat
        for column in range(ranks.shape[1]):  # every rank creates every group, in one order
            pair = [int(ranks[first, column]), int(ranks[last, column])]
            group = dist.new_group(pair)
            if dist.get_rank() in pair:
                self.group = group
        if self.info.is_first:
            self.copy = input_embeddings(model).weight
        elif self.info.is_last:
            self.copy = output_embeddings(model).weight

    def sum(self) -> None:
        import torch.distributed as dist

        if self.copy is None:
            return  # a middle stage: neither copy is here
        if self.copy.grad is None:  # the other end stage sums in its gradient all the same
            self.copy.grad = torch.zeros_like(self.copy)
        grad = self.copy.grad
        placements = getattr(self.copy, "placements", None)
        if placements is not None and grad.placements != placements:
            # the embedding's backward may leave its gradient replicated where the matrix
            # is sharded (the head's is sharded): both stages sum the same local pieces
            grad = grad.redistribute(placements=placements)
            self.copy.grad = grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=self.group)

    def counted(self) -> list[nn.Parameter]:
        """The parameters a gradient norm sums over: the last stage leaves its copy out."""
        return [p for p in self.model.parameters() if not (self.info.is_last and p is self.copy)]
