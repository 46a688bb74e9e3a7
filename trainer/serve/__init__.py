"""The endpoint's model server: the SageMaker inference contract, its speed levers, C2PA signing."""
