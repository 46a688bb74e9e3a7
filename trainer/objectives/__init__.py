"""Training objectives: what the model's output is regressed onto, from (output, latents, noise, timesteps)."""
