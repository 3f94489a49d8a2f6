"""Kernels (installed as `stream_ctr.ops`): each Triton kernel beside its torch reference.

    dispatch          which path an op takes (Triton on CUDA, a compiled loop or the reference on the CPU)
    cowclip_adam      fused CowClip + sparse Adam over the rows of a batch (Triton, a compiled
                      CPU loop, the torch reference)
    embedding_gather  gather of unique rows into batch slots, and its backward
    jagged_pool       sum/mean pooling of bags of unique rows (multi-hot fields), and its backward
    cpu_rows          a compiled CPU loop for the references' row adds (bit-identical to index_add_)
    deepfm_input      DeepFM's FM term and bf16 DNN input in one pass over the embeddings (CPU)
    cpu_parts         run a compiled CPU loop over parts of its rows on threads
    unique            a batch's unique keys, inverse and counts (torch.unique's, by a hash map on the CPU)
    hash_probe        the stores' hash-map lookups and inserts: one Triton launch each on CUDA

Imports torch (and triton lazily, on the first Triton call; numba on the
first call of a compiled CPU loop); never the rest of stream_ctr.
"""
