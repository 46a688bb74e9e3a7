"""Pack stage: accepted samples (and imported tars) become sealed WebDataset shards."""
