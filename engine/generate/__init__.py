"""Running the attached model: chunked prefill, the summarizer (map, then reduce), the embedder, what a sentence is,
the caller's check, and the measured chunk length."""
