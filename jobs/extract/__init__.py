"""Text extraction, isolated in a child process with limits, and the document formats it reads."""
