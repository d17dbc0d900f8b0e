"""Scoring backends: turn (query, document) pairs into relevance scores on 0..1."""
