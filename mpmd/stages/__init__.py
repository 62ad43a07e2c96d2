"""Stages: splitting a model into stages (split, marks), the Pipeline of stage functions, their programs, costs, shardings and names."""
