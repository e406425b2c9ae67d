"""Memory techniques that rewrite a model's modules: chunked MLPs, activation offloading, host-memory
trimming between layers, selective checkpointing (each applied by rlft/model/policy.py)."""
