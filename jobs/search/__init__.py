"""The search index: passages, their vectors and words, in the home's database."""
