"""The `atelier` command line: partners, uploads, imports, status, reports, lineages, deploys and the local stack."""
