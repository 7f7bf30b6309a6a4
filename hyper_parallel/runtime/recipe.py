"""``Recipe``: a loaded recipe as one model build carries it.

The loaded config (its path and ``where`` for messages), the recipe projected into the
codegen spec once, and the model folder's HF config read once, with the recipe's
overrides and attention kernel. A model build makes one ``Recipe`` and passes it down,
so nothing below re-projects the recipe or re-reads ``config.json``.
"""

from dataclasses import dataclass
from typing import Any

from hyper_parallel.config.layout import Layout
from hyper_parallel.config.schema import TrainerConfig
from hyper_parallel.runtime import build


@dataclass(frozen=True)
class Recipe:
    config: TrainerConfig
    spec: Any  # codegen's CodegenSpec, made through runtime/build.py
    hf_config: Any

    @classmethod
    def load(cls, config: TrainerConfig, *, workspace_root: Any = None) -> "Recipe":
        """``workspace_root``: the pipeline workspace (None: ``$HYPER_PARALLEL_WORKSPACE``
        or ``./generated``)."""
        spec = build.project_recipe(config, workspace_root or None)
        hf_config = build.recipe_hf_config(spec)
        hf_config._attn_implementation = config.model.attn_implementation
        return cls(config=config, spec=spec, hf_config=hf_config)

    @property
    def where(self) -> str:
        """The recipe file as messages name it."""
        return self.config.where

    @property
    def layout(self) -> Layout:
        return self.spec.layout
