"""Text data: tokenizing and sorting texts, collating batches, putting results back in input order."""
