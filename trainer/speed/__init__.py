"""Speed levers of the training step."""
