"""The job queue: one table on SQLite or PostgreSQL, its schema and dialects."""
