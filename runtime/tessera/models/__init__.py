"""The Llama-family model, its parallel layers, the weight loader and model-reference resolution."""
