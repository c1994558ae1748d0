"""Katz backoff trigram: the draft of the draft."""
