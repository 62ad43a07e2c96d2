"""Programs on groups of slices, and handles to the arrays they leave there."""
