"""Generated bundle for ../qwen3_0_6b_1gpu.yaml (hyper-parallel codegen; do not edit).

Import it with ``hyper_parallel.runtime.loader.load_generated_module(<this folder>)``;
the model class is ``modeling_Qwen3_gen_cuda.Qwen3ForCausalLM``.
"""

MODELING_MODULE = "modeling_Qwen3_gen_cuda"
MODEL_CLASS = "Qwen3ForCausalLM"
