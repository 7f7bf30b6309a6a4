"""Generated bundle for ../quickstart.yaml (hyper-parallel codegen; do not edit).

Import it with ``hyper_parallel.runtime.loader.load_generated_module(<this folder>)``;
the model class is ``modeling_Qwen3_gen_cpu.Qwen3ForCausalLM``.
"""

MODELING_MODULE = "modeling_Qwen3_gen_cpu"
MODEL_CLASS = "Qwen3ForCausalLM"
