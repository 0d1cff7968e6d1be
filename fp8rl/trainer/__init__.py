"""The RL trainer: the loop (`loop.py`), the job around it (`run.py`), checkpoints and the warm start."""
