"""Import stage: existing WebDataset tars become pipeline shards, sealed and announced like packed ones
(docs/import.md): importer (one tar, exactly once), source_tar (a tar read as samples), records (what
became of a tar and of its batch)."""
