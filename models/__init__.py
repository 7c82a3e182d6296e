"""The bundled demo models: a target and a draft sharing one tokenizer.

Each model lives in a folder of its own here, exported both as a Hugging Face folder (for the
torch worker) and as GGUF files (for the llama.cpp worker); they install as package data so the
daemon serves them when no model is configured. The script that trains and exports them, and
their model card, arrive with the demo-models work.
"""
