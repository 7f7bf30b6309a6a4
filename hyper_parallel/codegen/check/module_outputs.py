"""Each module's forward output on the probe, for verify's diagnosis of a failed check:
the first module whose output differs from the one-process reference's is where the
divergence starts (verify.py's ``_first_divergence``)."""

from typing import Any


def module_outputs(model, batch, pipeline=None) -> dict[str, Any]:
    """Each module's first output tensor as it leaves the module (after the plan's output
    conversion; DTensors gathered), in the order they were made. Modules that ran more
    often than once a micro-batch (an expert loop's activation) are left out: one output
    says little of them. Under pp, ``pipeline`` (verify_worker's ``PipelineRun``) runs the batch once per micro-batch and a
    rank reports only the modules of its own stages: not what it took out, and before the
    last stage not the model or its base model (their output there is a stage's, not the
    model's)."""
    import torch

    from hyper_parallel.distributed.pipeline import STAGE_ATTRIBUTE, pruned_names

    skip = set(pruned_names(model))
    info = model.__dict__.get(STAGE_ATTRIBUTE)
    if info is not None and not info.is_last:
        skip |= {name for name, module in model.named_modules() if module is model or module is model.base_model}
    runs = pipeline.microbatches if pipeline is not None else 1
    outputs: dict[str, Any] = {}
    counts: dict[str, int] = {}
    handles = []

    def hook(name):
        def record(module, args, output):
            value = _first_tensor(output)
            if value is None:
                return
            counts[name] = counts.get(name, 0) + 1
            if name in outputs:
                return
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            outputs[name] = value.detach().clone()
        return record

    if pipeline is not None:
        with torch.no_grad():
            pipeline.forward(batch)  # the stages' first run infers their shapes: not the model's outputs
    for name, module in model.named_modules():
        if name not in skip:
            handles.append(module.register_forward_hook(hook(name)))
    with torch.no_grad():
        if pipeline is not None:
            pipeline.forward(batch)
        else:
            model(input_ids=batch, labels=batch)
    for handle in handles:
        handle.remove()
    return {name: value for name, value in outputs.items() if counts[name] == runs}


def _first_tensor(output):
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    for key in ("logits", "last_hidden_state"):
        value = getattr(output, key, None)
        if isinstance(value, torch.Tensor):
            return value
    return None
