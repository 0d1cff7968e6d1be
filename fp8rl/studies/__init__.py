"""Studies that use the trainer's parts outside the RL loop (the one-step mechanism study)."""
