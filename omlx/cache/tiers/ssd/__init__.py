"""The SSD tier: one safetensors file per block (format), its index, its reader and writer threads."""
