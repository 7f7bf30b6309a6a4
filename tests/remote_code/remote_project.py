"""A throwaway project whose recipe points at a remote-code model folder: the fused
decoder in tests/data/remote_code/fused_decoder, a family transformers and the planner
have never seen, copied next to the recipe."""

import shutil
from pathlib import Path

from tests.project_fixtures import REPO, make_project

MODEL_DATA = REPO / "tests/data/remote_code/fused_decoder"
RECIPE = "recipes/remote/fused_tp2.yaml"
MODEL_DIR = "recipes/remote/models/fused_decoder"
BUNDLE = "recipes/remote/generated"
MODELING_FILE = "modeling_Hp_Fused_Decoder_gen_cpu.py"
SIBLING = "configuration_fused.py"
# Generation and its preflight read the model folder only: they must work offline.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

RECIPE_TEXT = """\
# The fused decoder (remote code: auto_map in its config.json) at tp 2 on 2 CPU processes.
model:
  pretrained_model_name_or_path: models/fused_decoder
  trust_remote_code: true
  torch_dtype: float32
  attn_implementation: eager

accelerator:
  device_type: cpu
  nproc_per_node: 2
  nnodes: 1
  tp_size: 2

codegen: true
"""


def make_remote_project(dest: Path) -> Path:
    """dodo.py + recipes/ + the remote-code recipe and its model folder."""
    project = make_project(dest)
    shutil.copytree(MODEL_DATA, project / MODEL_DIR, ignore=shutil.ignore_patterns("__pycache__"))
    (project / RECIPE).write_text(RECIPE_TEXT)
    return project
