"""The jobs layer: the job queue (queue/), inbox files, text extraction (extract/), the per-document pipeline and
its outputs, the search index (search/)."""
