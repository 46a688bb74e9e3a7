"""The training image: encode, autoencoder, train, evaluate and serve, with the SageMaker container contract."""
