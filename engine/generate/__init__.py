"""Chunked prefill, summaries decoded from the prefilled cache, and the measured chunk length."""
