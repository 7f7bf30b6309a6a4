"""The small files of a bundle besides the modeling file."""

from hyper_parallel.codegen.spec.types import CodegenSpec


def render_bundle_init(spec: CodegenSpec, model_class: str) -> str:
    module = spec.modeling_file[:-3]
    return (
        f'"""Generated bundle for {spec.recipe_rel} (hyper-parallel codegen; do not edit).\n\n'
        f"Import it with ``hyper_parallel.runtime.loader.load_generated_module(<this folder>)``;\n"
        f'the model class is ``{module}.{model_class}``.\n"""\n\n'
        f'MODELING_MODULE = "{module}"\n'
        f'MODEL_CLASS = "{model_class}"\n'
    )
