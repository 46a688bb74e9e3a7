"""Atelier's pure, typed domain code, shared by every Lambda function."""
