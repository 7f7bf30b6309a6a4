"""Recipe → codegen spec projection and signatures (torch-free)."""

from hyper_parallel.codegen.spec.project import (
    model_token,
    modeling_file_name,
    project_codegen_spec,
    signature_from_spec,
    stage_signature,
)
from hyper_parallel.codegen.spec.types import STAGES, CodegenSpec

__all__ = ["STAGES", "CodegenSpec", "model_token", "modeling_file_name",
           "project_codegen_spec", "signature_from_spec", "stage_signature"]
