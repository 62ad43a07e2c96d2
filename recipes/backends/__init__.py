"""The built-in cluster backends, one module each; importing this package registers them (in
this order: the order cluster.backend lists them). A new backend is a module like these that
calls mpmd.recipes.registry.register_backend_spec, imported here or named in a config's
`imports:`."""

from mpmd.recipes.backends import inprocess, local, static, ray, shared  # noqa: F401
