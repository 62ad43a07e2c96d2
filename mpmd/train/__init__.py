"""Training: the Trainer and its parts (dispatch, checkpoints over both tiers, recovery and relayout, elastic layouts)."""
