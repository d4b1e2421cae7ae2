"""draftsmith: data."""
