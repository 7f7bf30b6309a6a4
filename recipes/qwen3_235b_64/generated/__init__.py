"""Generated bundle for ../qwen3_235b_a22b_64.yaml (hyper-parallel codegen; do not edit).

Import it with ``hyper_parallel.runtime.loader.load_generated_module(<this folder>)``;
the model class is ``modeling_Qwen3_Moe_gen_npu.Qwen3MoeForCausalLM``.
"""

MODELING_MODULE = "modeling_Qwen3_Moe_gen_npu"
MODEL_CLASS = "Qwen3MoeForCausalLM"
