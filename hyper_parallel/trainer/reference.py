"""The recipe trained by single-process HF: what a parallel run must reproduce.

Same checkpoint, the trainer's batches and micro-batching, AdamW with the recipe's
settings; per step the loss and the global gradient norm. Benches and tests compare
the trainer's ``--metrics`` with it.
"""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hyper_parallel.config import load_training_config
from hyper_parallel.trainer.data import global_batch, micro_batches


def reference_training(recipe: str | Path) -> list[dict]:
    """``[{"loss", "grad_norm"}]`` per step of single-process HF training of ``recipe``."""
    recipe = Path(recipe)
    config = load_training_config(str(recipe))
    model = AutoModelForCausalLM.from_pretrained(recipe.parent / config.model.pretrained_model_name_or_path,
                                                 attn_implementation="eager", dtype=torch.float32,
                                                 trust_remote_code=config.model.trust_remote_code)
    opt = config.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                  weight_decay=opt.weight_decay, foreach=False)
    records = []
    for step in range(config.training.steps):
        batch = global_batch(step, config.training, config.dataset, model.config.vocab_size)
        parts = list(micro_batches(batch, 0, 1, config.training.micro_batch_size, "reference"))
        total = 0.0
        for micro in parts:
            loss = model(input_ids=micro, labels=micro).loss / len(parts)
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        records.append({"loss": total, "grad_norm": norm})
    return records
