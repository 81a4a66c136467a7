"""Real checkpoints -> Glassformer: GGUF files (gguf.py), Hugging Face folders (huggingface.py),
and back to Hugging Face (export.py). Each loader returns (Transformer, tokenizer)."""
