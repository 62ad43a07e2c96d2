"""Running a recipe: the training loop, its log and console, preemption, the dry run, generation."""
