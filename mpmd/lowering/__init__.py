"""Lowering: a schedule and a pipeline's stage programs become per-slice programs and instruction streams (core); the dry run sizes a run without allocating it (dryrun)."""
