"""The durable job queue, document text extraction and the per-document pipeline."""
