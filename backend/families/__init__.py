"""Each family's reader of its Hugging Face config.json (and, where the GGUF layout needs more than the common
keys, of its GGUF metadata) into a ModelConfig and one LayerSpec a layer. hf_config.py picks the reader by
architecture."""
