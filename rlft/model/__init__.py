"""What loads or rewrites an nn.Module: loading, dtype, LoRA and checkpointing (loading.py), the
policy and its reference as a trainer holds them (policy.py), the fused-head scoring forward
(scoring.py), packed inputs (packing.py), and the memory techniques (memory/)."""
