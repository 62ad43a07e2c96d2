"""Small examples of what a config can point at (model.module = "recipes.examples.x:fn")."""
