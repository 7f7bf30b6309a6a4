"""What a verify or preflight rank imports before it starts, so a forked launcher
(``launch/forked_torchrun.py``) can import it once for every rank."""

# What every verify and preflight rank imports, heaviest first.
RANK_IMPORTS = ("transformers", "torch.distributed.tensor", "torch.distributed.fsdp", "hyper_parallel.runtime.loader",
                "hyper_parallel.codegen.plan.derive", "hyper_parallel.distributed.applier",
                "hyper_parallel.distributed.mesh", "hyper_parallel.codegen.check.preflight")


def rank_preload(source) -> list[str]:
    """The modules a rank of this model imports: the common ones and, for a model
    transformers ships, its modeling module (a remote model's is loaded from its folder)."""
    return [*RANK_IMPORTS, *([source.module] if source is not None and not source.is_remote else [])]
