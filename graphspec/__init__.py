"""graphspec: lossless speculative decoding as a graph of stages."""
