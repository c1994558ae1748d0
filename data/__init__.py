"""Corpus, tokenizer, token shards and prompt sets: the first stage of every pipeline."""
