"""Small examples of what a config can point at (model.module = "mpmd.recipes.examples.x:fn")."""
