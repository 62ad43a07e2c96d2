"""The built-in model families, one module each; importing this package registers them (in
this order: the order model.kind lists them). A new family is a module like these that calls
mpmd.recipes.registry.register_model_spec, imported here or named in a config's `imports:`."""

from mpmd.recipes.families import gpt, llama, moe, mlp, custom  # noqa: F401
