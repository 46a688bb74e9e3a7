"""The training image: encode, autoencoder, train, evaluate and serve, with the SageMaker container contract.

By concern: models/ (presets, loading, text encoding, pipelines), objectives/ (what the model is
trained to predict), data/ (shards to batches), jobs/ (one module per task, and the shared step),
serve/ (the endpoint), speed/ (measured levers), runtime/ (processes, checkpoints, health),
report/ (report.html). container.py is the image's entrypoint; launch.py runs on an operator's machine.
"""
