"""Tables, figures and provenance rebuilt from MLflow (``python -m fp8rl.report``, the make targets).

Nothing here trains: every number comes from a finished MLflow run, and every file written names the
runs it came from (``<table>.runs.csv``, ``PROVENANCE.json``).
"""
