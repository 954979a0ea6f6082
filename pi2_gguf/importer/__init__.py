"""`pi2-gguf import`: Hugging Face checkpoints of activation-sparse models to standard GGUF files that state
their FFN activation, through llama.cpp's own converter and quantizer."""
