"""The embedded demo model: its corpus, tokenizer, training, model card and the studies of its candidates."""
