"""The unit of caching: a block, its host bytes and checksum, its key, and how its tensors hold each kind of layer."""
