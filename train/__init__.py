"""draftsmith: train."""
