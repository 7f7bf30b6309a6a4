"""The causal-LM head's loss and output for ``models/common`` decoders, in transformers'
conventions, so the trainer trains a custom-backend model like an HF one:
``model(input_ids=ids, labels=ids).loss``.

``causal_lm_loss`` is HF's ``ForCausalLMLoss``: labels shifted left by one inside the loss
(the last position gets ``ignore_index``), cross entropy in float32, the mean over labels
that are not ``ignore_index`` (or over ``num_items_in_batch``). It is the decoder's
``loss_function``; when the plan leaves the logits sharded (loss parallel over the vocab,
or the sequence over cp) the applier replaces it with the project's sharded cross entropy
(``distributed/sharded_loss.py``), exactly as it does for HF models."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class CausalLMOutput:
    """What ``forward(input_ids=..., labels=...)`` returns (HF's field names)."""

    loss: torch.Tensor | None
    logits: torch.Tensor


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, num_items_in_batch=None,
                   ignore_index: int = -100, shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """HF's causal-LM loss on whole logits ``[b, s, vocab]`` (a DTensor the plan left
    replicated is gathered first)."""
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits.float().reshape(-1, vocab_size), shift_labels.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    return loss
