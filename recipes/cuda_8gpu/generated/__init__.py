"""Generated bundle for ../qwen3_30b_a3b_8gpu.yaml (hyper-parallel codegen; do not edit).

Import it with ``hyper_parallel.runtime.loader.load_generated_module(<this folder>)``;
the model class is ``modeling_Qwen3_Moe_gen_cuda.Qwen3MoeForCausalLM``.
"""

MODELING_MODULE = "modeling_Qwen3_Moe_gen_cuda"
MODEL_CLASS = "Qwen3MoeForCausalLM"
