"""The job queue on SQLite or PostgreSQL: one database (database.py) holding the jobs (store.py's Queue), the
watcher's memory of handed files (handed.py), the daemons' rows (daemons.py) and the person's switches
(controls.py), with its schema and dialects."""
