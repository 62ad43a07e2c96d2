"""Data sources and what feeds them: loaders, tokenizers, tokenized corpora, fine-tuning sets."""
