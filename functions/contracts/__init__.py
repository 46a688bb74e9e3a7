"""Names that cross a boundary (Lambdas, trainer, CLI): messages, table layout, S3 layout, tags."""
