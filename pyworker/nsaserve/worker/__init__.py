"""The tensor-parallel worker process: receives batch plans, runs the model, replies with tokens."""
