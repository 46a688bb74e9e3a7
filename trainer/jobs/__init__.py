"""The image's jobs, one module each (`task=` of trainer/container.py): train, encode, evaluate, autoencoder."""
