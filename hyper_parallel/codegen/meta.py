"""Writing codegen_meta.json: what a bundle is, what it was built from, and what it
covers. Reading it is the runtime's (``runtime/meta.py``)."""

import json
from typing import Any

from hyper_parallel.codegen.hash import sha256_bytes, sha256_json
from hyper_parallel.codegen.spec.types import CodegenSpec
from hyper_parallel.runtime.meta import META_SCHEMA_VERSION

NOT_COVERED = (
    "pipeline_parallel: the stage split is recorded in the plan (pipeline.stages); the trainer runs the stages "
    "with torch.distributed.pipelining",
    "data_parallel: FSDP2 fully_shard over dp is applied by the trainer",
    "activation_checkpointing, torch.compile and DeviceMesh construction are owned by the runtime",
)


def build_codegen_meta(spec: CodegenSpec, *, signature: str, files: dict[str, bytes],
                       frozen: dict[str, Any], model_class: str, verified: dict[str, Any],
                       weight_map: dict[str, Any]) -> bytes:
    """The meta's bytes. ``weight_map``: checkpoint tensor name (pattern) → the parameter
    part it fills (``distributed/weight_map.py``), which the sharded loader and the
    trainer's checkpoints read."""
    meta = {
        "schema_version": META_SCHEMA_VERSION,
        "signature": signature,
        "generator": "hyper-parallel codegen",
        "recipe": spec.recipe_rel,
        "source": spec.source.identity(),
        "model": {"dir": spec.model_dir_rel, "config_sha256": spec.model_config_sha256,
                  "config_overrides": spec.config_overrides, "model_class": model_class,
                  "model_type": spec.source.model_type},
        "parallel": spec.parallel_record(),
        "modeling_file": spec.modeling_file,
        "outputs": {name: sha256_bytes(data) for name, data in sorted(files.items())},
        "plan": {"entries": len(frozen["modules"]), "applied_axes": frozen["applied_axes"],
                 "recorded_axes": frozen["recorded_axes"],
                 "sha256": sha256_json(frozen)},
        "verified": verified,
        "weight_map": weight_map,
        "covered": {"sharding_plan": bool(frozen["modules"]),
                    "module_overrides": bool(spec.replacements),
                    "weight_map": bool(weight_map)},
        "not_covered": list(NOT_COVERED),
    }
    return (json.dumps(meta, indent=2, sort_keys=False) + "\n").encode()
