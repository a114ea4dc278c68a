"""Independent oracles for whole-model tests: a float64 numpy forward pass over GGUF files
(numpy_forward) and tiny Hugging Face models converted by llama.cpp's real converter (hf_export).
Nothing here imports sharpi."""
