"""The recipe trained by single-process HF: what a parallel run must reproduce.

Same checkpoint, the trainer's batches and micro-batching, AdamW with the recipe's
settings, its lr schedule and evaluation, the recipe's precision (float32 masters,
autocast compute), clipping; per step the loss and the global gradient norm. Benches and tests compare
the trainer's ``--metrics`` with it.
"""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hyper_parallel.config import load_training_config
from hyper_parallel.config.schema import TOKENIZED_KINDS
from hyper_parallel.distributed.step_seed import seed_step
from hyper_parallel.models.hf.model_builder import parameter_dtype, recipe_model_dir
from hyper_parallel.trainer.corpus import corpus_batch, prepare_corpus
from hyper_parallel.trainer.data import global_batch, micro_batches, read_byte_tokens
from hyper_parallel.trainer.evaluation import due, eval_batches, eval_loss, hold_out
from hyper_parallel.trainer.precision import compute_context
from hyper_parallel.trainer.schedule import set_learning_rate


# fp32's relative precision: the size of the error a different summation order (a sharded
# matmul, an all-reduce) leaves in a gradient, relative to the tensor's largest element.
ROUNDING_NOISE = 2.0 ** -23


def add_rounding_noise(parameters, generator: torch.Generator) -> None:
    """Perturb every gradient by ROUNDING_NOISE x its largest element x N(0, 1).

    Why: AdamW's first steps divide each element by its own magnitude (``g / (|g| + eps)``),
    so an element whose true gradient is near zero moves by up to ``lr`` on a rounding-sized
    change of sign or size. Training a second reference with this noise measures how far
    AdamW alone carries rounding differences on this model: a parallel run that agrees with
    one process to within that is as close as a different summation order allows."""
    for param in parameters:
        if param.grad is not None:
            scale = ROUNDING_NOISE * param.grad.abs().max()
            param.grad.add_(scale * torch.randn(param.grad.shape, generator=generator, dtype=param.grad.dtype))


def reference_training(recipe: str | Path, rounding_noise: bool = False, gradients: bool = False) -> list[dict]:
    """``[{"loss", "grad_norm", "lr"(, "eval_loss")}]`` per step of single-process HF training of ``recipe``;
    with ``rounding_noise`` each step's gradients are perturbed (``add_rounding_noise``)
    after the step's record is taken, so only later steps feel it; with ``gradients`` each
    record also holds ``"grads"``: every parameter's gradient before clipping and update."""
    recipe = Path(recipe)
    config = load_training_config(str(recipe))
    model = AutoModelForCausalLM.from_pretrained(recipe_model_dir(config),
                                                 attn_implementation="eager", dtype=parameter_dtype(config),
                                                 trust_remote_code=config.model.trust_remote_code).train()
    opt = config.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=tuple(opt.betas),
                                  weight_decay=opt.weight_decay, foreach=False)
    records, generator = [], torch.Generator().manual_seed(0)
    training, dataset = config.training, config.dataset
    corpus = byte_tokens = None
    if dataset.kind in TOKENIZED_KINDS:  # the trainer's packed rows, in the trainer's order
        corpus = prepare_corpus(dataset, training, recipe_model_dir(config),
                                str(recipe), log=False)
    elif dataset.kind == "bytes":
        byte_tokens = read_byte_tokens(dataset, model.config.vocab_size, training.global_batch_size * training.seq_len,
                                       str(recipe))
    held_rows = None
    if corpus is not None:  # the trainer's split: training rows, then training.eval's
        corpus, held_rows = hold_out(corpus, config)
    evaluation = eval_batches(config, model.config.vocab_size, held_rows) if training.eval is not None else []
    for step in range(config.training.steps):
        if corpus is not None:
            batch = corpus_batch(corpus, step * training.global_batch_size, training, dataset.shuffle)
        else:
            batch = global_batch(step, training, dataset, model.config.vocab_size, byte_tokens)
        seed_step(step, config.training.seed)
        parts = list(micro_batches(batch, 0, 1, config.training.micro_batch_size, "reference"))
        total = 0.0
        for micro in parts:
            with compute_context(config, fsdp_casts=False):  # the recipe's precision, by autocast
                loss = model(input_ids=micro, labels=micro).loss / len(parts)
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()} if gradients else None
        if rounding_noise:
            add_rounding_noise(model.parameters(), generator)
        if training.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), training.max_grad_norm, foreach=False)
        lr = set_learning_rate(optimizer, opt.lr, step + 1, training)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record = {"loss": total, "grad_norm": norm, "lr": lr, **({"grads": grads} if gradients else {})}
        if due(step + 1, config):
            record["eval_loss"] = eval_loss(model, evaluation, dp_rank=0, dp_size=1,
                                            micro_batch_size=training.micro_batch_size,
                                            compute=lambda: compute_context(config, fsdp_casts=False))
        records.append(record)
    return records
