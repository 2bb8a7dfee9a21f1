"""Whole documents, decoding included (`bench document`), and the full-size target they run on (`bench make-target`)."""
