"""The tuner: profile stage costs, search splits, schedules and microbatch counts, confirm the pick by measurement."""
